"""Host offload of saved activations (the "swap" half of MEMO), through saved_tensors_hooks.

Inside `HostOffloader.block(i)` / `.offload(fraction)`, every tensor autograd saves for backward
is split: the first `fraction` of its elements (for a [batch, tokens, ...] activation with batch 1:
the first tokens) is copied to the host tier and the rest is kept on the device; the device copy
of the original is then free to go. In backward the parts are joined again.

- On CUDA the host tier is pinned memory; device-to-host copies run on a side stream after the
  producing kernels, and when backward reaches block i, block i-1's host parts are already being
  copied back on that stream (prefetch one block ahead), so the transfers overlap compute.
- On CPU the same mechanism runs with a separate host buffer per saved tensor (a copy), so the
  policy, its accounting and its gradients are tested on any machine.

Never offloaded: parameters, their autocast copies (a cast of a parameter; weights are not
activations) and the tensors the caller declares `shared` (RoPE tables and document ids that all
blocks read). A tensor saved twice in one block (the same tensor object) is copied once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a dtype cast of one (autocast's cached bf16 weight)."""
    if isinstance(t, nn.Parameter):
        return True
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


class _Saved:
    """One saved tensor: its host part, its device rest, and (CUDA) a prefetched host part."""

    __slots__ = ("host", "rest", "shape", "prefetched", "event", "__weakref__")

    def __init__(self, host, rest, shape):
        self.host, self.rest, self.shape = host, rest, shape
        self.prefetched, self.event = None, None


class HostOffloader:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._blocks: dict[int, weakref.WeakSet] = {}  # block -> its saved parts (alive until backward)
        self._order: list[int] = []  # blocks in forward order, for "the block backward reaches next"
        self._host_parts: weakref.WeakSet | None = None
        self._block: int | None = None
        self._seen: dict[int, tuple] = {}
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
                or t.untyped_storage().data_ptr() in self._shared):
            return t
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]
        flat = t.reshape(-1)
        cut = round(self._fraction * flat.numel())
        if cut == 0:
            return t
        rest = flat[cut:].clone() if cut < flat.numel() else None
        saved = _Saved(self._to_host(flat[:cut]), rest, t.shape)
        self._blocks[self._block].add(saved)
        self._seen[id(t)] = (weakref.ref(t), saved)
        return saved

    def _to_host(self, part: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            host = part.clone()  # the host tier on a CPU machine: a separate buffer
        else:
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(part, non_blocking=True)
            part.record_stream(self.stream)  # keep the device memory until the copy has run
        self.host_tensors.append(weakref.ref(host))
        return host

    # ------------------------------------------------------------------ backward side
    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        block = next((b for b, parts in self._blocks.items() if saved in parts), None)
        if block is not None:
            self._prefetch_before(block)
        part = self._host_part_on_device(saved)
        whole = part if saved.rest is None else torch.cat([part, saved.rest])
        return whole.view(saved.shape)

    def _host_part_on_device(self, saved: _Saved) -> torch.Tensor:
        if not self.cuda:
            return saved.host
        current = torch.cuda.current_stream(self.device)
        if saved.prefetched is not None:
            current.wait_event(saved.event)
            part, saved.prefetched = saved.prefetched, None
            part.record_stream(current)
            return part
        current.wait_stream(self.stream)  # the device-to-host copy must have landed
        return saved.host.to(self.device, non_blocking=True)

    def _prefetch_before(self, block: int) -> None:
        """Backward reached `block`: start bringing back the block that comes after it (i - 1)."""
        if not self.cuda:
            return
        pos = self._order.index(block) if block in self._order else -1
        if pos <= 0:
            return
        nxt = self._order[pos - 1]
        parts = self._blocks.pop(nxt, None)
        if parts is None:
            return
        self._blocks[nxt] = parts  # keep it findable for its own unpacks
        self._order = self._order[:pos]  # nothing to prefetch twice
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for saved in list(parts):
                if saved.prefetched is None:
                    saved.prefetched = saved.host.to(self.device, non_blocking=True)
                    saved.event = torch.cuda.Event()
                    saved.event.record(self.stream)

    # ------------------------------------------------------------------ accounting
    def host_storage_ptrs(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for r in self.host_tensors if (t := r()) is not None}
