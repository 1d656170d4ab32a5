"""Host offload of saved activations (the "swap" half of MEMO), through saved_tensors_hooks.

Inside `HostOffloader.block(i)` / `.offload(fraction)`, every tensor autograd saves for backward
is split: the first `fraction` of its elements (for a [batch, tokens, ...] activation with batch 1:
the first tokens) is copied to the host tier and the rest is kept on the device; the device copy
of the original is then free to go. In backward the parts are joined again.

- On CUDA the host tier is pinned memory; device-to-host copies run on a side stream after the
  producing kernels, and block i-1's host parts are copied back on that stream while block i's
  backward still runs (prefetch one block ahead), so the transfers overlap compute.
- When the prefetch starts decides the device peak. Started as backward reaches block i (its first
  unpack: `prefetch_on_unpack`, the default of a bare offloader), block i-1's parts sit on the device
  through all of block i's backward, its peak included: with full recomputation a second block
  input, under selective a second block's whole host tier (its stored activations too), so a model
  with two offloaded blocks or more peaked that much above one with a single one. The policies
  (memory/apply_policy.py) therefore start it later: `prefetch_mark(i - 1)` in block i's forward
  marks q, k and v, and their backward (after block i's attention core, before its q/k/v projections:
  the smallest phase of the block's backward) brings block i-1 back, under full and selective alike.
- On CPU the same mechanism runs with a separate host buffer per saved tensor (a copy), used where
  it is when it comes back (`_fetch`: no second copy on a machine with one memory), so the policy,
  its schedule, its accounting and its gradients are tested on any machine.

Never offloaded: parameters, their autocast copies (a cast of a parameter; weights are not
activations) and the tensors the caller declares `shared` (RoPE tables and document ids that all
blocks read). A span of storage saved several times in one block (as different views) is copied once.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

from ..ops.chunked import host_copy, is_chunk_store_host

_VIEW_OR_CAST = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0",
                 "ToCopyBackward0", "AliasBackward0", "UnsafeViewBackward0",
                 # an expert weight under expert parallelism: DTensor.to_local, then parallel/expert/install.py's
                 # identity that scales its gradient
                 "_ToTorchTensorBackward", "_ScaleGradBackward"}


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view or dtype cast of one (a linear's transposed weight, autocast's bf16 copy)."""
    if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        if name not in _VIEW_OR_CAST or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


class _Region:
    """A span of one storage saved for backward: its first part on the host, the rest on the device.
    Every saved view inside the span shares it (a linear's 2-D view of the norm output, saved once
    by each of q, k and v, is copied once)."""

    __slots__ = ("__weakref__", "_full", "block", "event", "host", "prefetched", "rest")

    def __init__(self, host, rest, block: int):
        self.host, self.rest, self.block = host, rest, block
        self.prefetched, self.event, self._full = None, None, None


class _View:
    __slots__ = ("offset", "region", "shape", "stride")

    def __init__(self, region, offset, shape, stride):
        self.region, self.offset, self.shape, self.stride = region, offset, shape, stride


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) in elements of t's storage that t can touch."""
    lo = t.storage_offset()
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


class _PrefetchAfter(torch.autograd.Function):
    """Identity on (q, k, v) whose backward, once their gradients are all in (the attention core's
    backward is done), starts `prefetch()`."""

    @staticmethod
    def forward(ctx, prefetch, q, k, v):
        ctx.prefetch = prefetch
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.prefetch()
        return None, dq, dk, dv


class HostOffloader:
    def __init__(self, device: torch.device, prefetch_on_unpack: bool = True):
        self.device = torch.device(device)
        # True: block i-1 comes back as backward reaches block i; False: when a prefetch_mark fires
        self.prefetch_on_unpack = prefetch_on_unpack
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._blocks: dict[int, weakref.WeakSet] = {}  # block -> its saved parts (alive until backward)
        self._order: list[int] = []  # blocks in forward order, for "the block backward reaches next"
        self._block: int | None = None
        self._seen: dict[tuple, list] = {}  # (storage, dtype) -> regions saved in the current block
        self._shared: set[int] = set()
        self._fraction = 0.0
        self.host_tensors: list[weakref.ref] = []  # for accounting: which storages are the host tier

    # ------------------------------------------------------------------ forward side
    @contextlib.contextmanager
    def block(self, index: int, shared=()):
        """The scope of one block's forward: parts saved inside belong to block `index`."""
        if not self._order or index <= self._order[-1]:  # a new forward pass started
            self._order, self._blocks = [], {}
            self.host_tensors = [r for r in self.host_tensors if r() is not None]
        self._order.append(index)
        self._blocks[index] = weakref.WeakSet()
        self._block, self._seen = index, {}
        self._shared = {t.untyped_storage().data_ptr() for t in shared if t is not None}
        try:
            yield self
        finally:
            self._block, self._seen, self._shared = None, {}, set()

    @contextlib.contextmanager
    def offload(self, fraction: float):
        """Saved tensors inside go `fraction` to the host (1.0: whole), the rest stays on the device."""
        if self._block is None:
            raise RuntimeError("HostOffloader.offload() must be used inside HostOffloader.block()")
        self._fraction = fraction
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor):
        if (t.device.type != self.device.type or t.numel() == 0 or _is_weight(t)
                or t.untyped_storage().data_ptr() in self._shared or is_chunk_store_host(t)):
            return t
        storage = t.untyped_storage()
        lo, hi = _span(t)
        regions = self._seen.setdefault((storage.data_ptr(), t.dtype), [])
        # a storage held below can still lose its memory to a resize (FSDP frees an unsharded weight's
        # storage after its module's forward), and a new tensor can then take the same address: a
        # span whose storage no longer has it is stale, and must not answer for the new tensor
        regions[:] = [r for r in regions if r[3].data_ptr() == storage.data_ptr() and r[3].nbytes()]
        # a span changed in place since it was copied holds other values now: it answers only for
        # tensors saved at the same version (autograd's own check is off under saved-tensor hooks)
        for r_lo, r_hi, region, _, version in regions:
            if r_lo <= lo and hi <= r_hi and version == t._version:
                return _View(region, lo - r_lo, t.shape, t.stride())
        flat = t.new_empty(0).set_(storage, lo, (hi - lo,), (1,))
        cut = round(self._fraction * (hi - lo))
        if cut == 0:
            return t
        region = _Region(self._to_host(flat[:cut]), flat[cut:].clone() if cut < hi - lo else None, self._block)
        self._blocks[self._block].add(region)
        # holding the storage until the block ends keeps its address from being reused by another
        # tensor while the span is still registered
        regions.append((lo, hi, region, storage, t._version))
        return _View(region, 0, t.shape, t.stride())

    def _to_host(self, part: torch.Tensor) -> torch.Tensor:
        host = host_copy(part, self.stream)  # pinned on CUDA; on a CPU machine a separate buffer
        self.host_tensors.append(weakref.ref(host))
        return host

    # ------------------------------------------------------------------ backward side
    def _unpack(self, saved):
        if not isinstance(saved, _View):
            return saved
        region = saved.region
        full = region._full() if region._full is not None else None
        if full is None:
            if self.prefetch_on_unpack:
                self._prefetch_before(region.block)
            part = self._host_part_on_device(region)
            full = part if region.rest is None else torch.cat([part, region.rest])
            region._full = weakref.ref(full)  # the other views of this span reuse it while it lives
        return full.as_strided(saved.shape, saved.stride, saved.offset)

    def _fetch(self, host: torch.Tensor) -> torch.Tensor:
        """A host part on the device: a copy on the current stream (CUDA; non-blocking from pinned
        memory), the host buffer itself on a CPU machine (one memory: a copy would only add a second)."""
        return host.to(self.device, non_blocking=True) if self.cuda else host

    def _host_part_on_device(self, saved: _Region) -> torch.Tensor:
        if saved.prefetched is not None:
            part, saved.prefetched = saved.prefetched, None
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(saved.event)
                part.record_stream(current)
            return part
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # the device-to-host copy must have landed
        return self._fetch(saved.host)

    def _prefetch_before(self, block: int) -> None:
        """Backward reached `block`: start bringing back the block that comes before it in forward order."""
        pos = self._order.index(block) if block in self._order else -1
        if pos <= 0:
            return
        nxt = self._order[pos - 1]
        self._order = self._order[:pos]  # nothing to prefetch twice
        self.prefetch(nxt)

    def prefetch(self, block: int) -> None:
        """Start bringing block `block`'s host parts back (on CUDA on the side stream, after the work
        queued so far); its unpack then takes them instead of copying. Nothing if it has none left."""
        parts = [saved for saved in self._blocks.get(block, ()) if saved.prefetched is None]
        if not parts:
            return
        if not self.cuda:
            for saved in parts:
                saved.prefetched = self._fetch(saved.host)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for saved in parts:
                saved.prefetched = self._fetch(saved.host)
                saved.event = torch.cuda.Event()
                saved.event.record(self.stream)

    def prefetch_mark(self, block: int):
        """mark(q, k, v) -> (q, k, v): the identity, whose backward (after the attention core's, in the
        block that applies it) starts `prefetch(block)`. Applied in the block after `block`, so `block`'s
        input comes back while that block's q/k/v projections run backward, not through its whole
        backward (see the module's docstring)."""
        return lambda q, k, v: _PrefetchAfter.apply(functools.partial(self.prefetch, block), q, k, v)

    # ------------------------------------------------------------------ accounting
    def host_storage_ptrs(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for r in self.host_tensors if (t := r()) is not None}
