"""Chunked attention core (FPDT's pipeline, with documents): a rank's tokens in chunks of C.

One attention call over S tokens holds, unchunked, everything for all S tokens at once: the
kernel's outputs and gradients, k/v repeated per query head (grouped-query attention), fp32
accumulators. Here the queries and the keys are cut into chunks of `chunk` tokens along the
sequence, and

- forward: for each query chunk i, the kernel runs against every key chunk j that it can see
  (causal, same document: a host-side SegmentPlan per (i, j), ops/segments.py; a pair with no
  visible key is never computed), and the partial results are merged in fp32 by the log-sum-exp,
  exactly as ring attention merges its blocks. What backward needs is kept per chunk: q, k, v,
  out and lse.
- backward: over key chunks j in reverse; for each, the query chunks that see it. dk_j / dv_j
  accumulate in fp32 for one chunk at a time; dq_i accumulates into its own chunk.

So the transient state of the core is O(C) (k/v repeated for one chunk, one pair's gradients, one
chunk's fp32 accumulators), not O(S). With `offload`, the kept chunks (q, k, v, out, lse, and the
fp32 dq accumulators) live in host memory (`ChunkStore`): pinned, copied on a side stream, and
brought back one chunk ahead of use, so the device holds one chunk of attention state at a time;
the price is O(u^2) chunk moves for u chunks (a key chunk meets every later query chunk).

Which pairs attend is a pure function of the tokens' global positions and document ids, so the
same code serves one device (positions 0..S-1) and every ring block (the layout's positions of
both ranks, parallel/context/ring.py). Chunking changes no result beyond the order of fp32 additions
for fp32 inputs; with bf16 inputs each chunk's key/value gradient is rounded to bf16 before the fp32 sum
(as each ring block's is): about 2-2.5x one unchunked bf16 pass's error (tests/distributed/
test_ring_edge_shapes_audit.py bounds it).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .attention import NEG_INF, attention_backward, attention_forward, merge_partials, stat_dtype
from .segments import SegmentPlan, _check_contiguous, host_ids, plan_pairs, segments, tensor_version


def chunk_slices(tokens: int, chunk: int) -> list[slice]:
    """Slices of at most `chunk` tokens covering `tokens` (0 = one slice)."""
    if chunk <= 0 or tokens <= chunk:
        return [slice(0, tokens)]
    return [slice(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]


class ChunkGrid:
    """The (query chunk, key chunk) pairs of one attention call and their segment plans, on the host.

    q_pos / k_pos: global positions [batch, seq] of the queries and keys (increasing along a row
    within each contiguous run); q_doc / k_doc: document ids of the same shape, or None for one
    document. Plans are built on first use and kept (a grid lives for one batch: every layer and
    its backward reuse it)."""

    def __init__(self, q_pos, k_pos, q_doc, k_doc, chunk: int, causal: bool):
        self.q_pos, self.k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
        if q_doc is None or k_doc is None:
            q_doc, k_doc = np.zeros_like(self.q_pos), np.zeros_like(self.k_pos)
        self.q_doc, self.k_doc = np.asarray(q_doc, dtype=np.int64), np.asarray(k_doc, dtype=np.int64)
        self.chunk, self.causal = chunk, causal
        self.q_slices = chunk_slices(self.q_pos.shape[1], chunk)
        self.k_slices = chunk_slices(self.k_pos.shape[1], chunk)
        # per chunk and row: the first and last position, to drop pairs whose keys all come later
        self._q_last = np.stack([self.q_pos[:, s].max(axis=1) for s in self.q_slices])
        self._k_first = np.stack([self.k_pos[:, s].min(axis=1) for s in self.k_slices])
        self._candidates = self._sharing_chunks()
        self._plans: dict[tuple[int, int], SegmentPlan | None] = {}

    def _sharing_chunks(self) -> list[set[int]]:
        """For each query chunk, the key chunks that hold a token of one of its documents (in some
        row): only those pairs can attend. Linear in the tokens plus the pairs found, so a long
        sequence of many documents never plans its u^2 / 2 chunk pairs one by one."""
        out: list[set[int]] = [set() for _ in self.q_slices]
        for r in range(self.q_doc.shape[0]):
            holders: dict[int, list[int]] = {}
            for j, ks in enumerate(self.k_slices):
                for d in np.unique(self.k_doc[r, ks]).tolist():
                    holders.setdefault(d, []).append(j)
            for i, qs in enumerate(self.q_slices):
                for d in np.unique(self.q_doc[r, qs]).tolist():
                    out[i].update(holders.get(d, ()))
        return out

    def plan(self, i: int, j: int) -> SegmentPlan | None:
        """The segment pairs of query chunk i against key chunk j; None when no query sees a key."""
        if (i, j) not in self._plans:
            plan = None
            if j in self._candidates[i] and not (self.causal and np.all(self._k_first[j] > self._q_last[i])):
                qs, ks = self.q_slices[i], self.k_slices[j]
                plan = plan_pairs(self.q_doc[:, qs], self.k_doc[:, ks], causal=self.causal,
                                  q_pos=self.q_pos[:, qs], k_pos=self.k_pos[:, ks])
                plan = None if plan.empty else plan
            self._plans[(i, j)] = plan
        return self._plans[(i, j)]

    def keys_of(self, i: int) -> list[int]:
        return [j for j in sorted(self._candidates[i]) if self.plan(i, j) is not None]

    def queries_of(self, j: int) -> list[int]:
        return [i for i in range(len(self.q_slices)) if j in self._candidates[i] and self.plan(i, j) is not None]

    def visible(self) -> int:
        """Query-key pairs that attend (the work of the call)."""
        return sum(p.visible() for i in range(len(self.q_slices)) for j in self._candidates[i]
                   if (p := self.plan(i, j)) is not None)


@functools.lru_cache(maxsize=16)
def _plain_grid(batch: int, seq: int, chunk: int, causal: bool) -> ChunkGrid:
    pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq))
    return ChunkGrid(pos, pos, None, None, chunk, causal)


def local_grid(batch: int, seq: int, doc_ids, chunk: int, causal: bool) -> ChunkGrid:
    """The grid of single-device attention: positions 0..seq-1 in every row, with the batch's
    document ids (a tensor: copied to the host once and the grid kept on it for the other layers);
    without documents one grid per shape serves every step."""
    if doc_ids is None:
        return _plain_grid(batch, seq, chunk, causal)
    key = (tensor_version(doc_ids), chunk, causal, tuple(doc_ids.shape))
    cached = getattr(doc_ids, "_longctx_chunk_grid", None)
    if cached is None or cached[0] != key or key[0] is None:  # (None: an inference tensor, never cached)
        ids = host_ids(doc_ids).astype(np.int64)
        for r, row in enumerate(ids):  # documents must be contiguous runs (checked once per batch)
            _check_contiguous(segments(row)[2], r)
        pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq))
        cached = (key, ChunkGrid(pos, pos, ids, ids, chunk, causal))
        doc_ids._longctx_chunk_grid = cached
    return cached[1]


# ----------------------------------------------------------------------------------------------
# Where the kept chunks live


_HOST_PTRS: set[int] = set()  # storages of every store's live host tier (for accounting and the offloader)


def _register_host(t: torch.Tensor) -> None:
    ptr = t.untyped_storage().data_ptr()
    _HOST_PTRS.add(ptr)
    weakref.finalize(t, _HOST_PTRS.discard, ptr)


def is_chunk_store_host(t: torch.Tensor) -> bool:
    """Whether `t` is (a view of) a ChunkStore's host copy: already where an offloader would put it."""
    return t.untyped_storage().data_ptr() in _HOST_PTRS


def chunk_store_host_ptrs() -> set[int]:
    """Storage addresses of the host-tier chunks alive in any ChunkStore (memory/accounting.py)."""
    return set(_HOST_PTRS)


def pinned_copy(t: torch.Tensor, stream) -> torch.Tensor:
    """A pinned host copy of device tensor `t`, made on `stream` after the kernels that produce `t`
    (the device memory is kept until the copy has run)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)
    return host


def host_copy(t: torch.Tensor, stream) -> torch.Tensor:
    """The host tier's copy of `t`: pinned, made on `stream` (pinned_copy) for a CUDA tensor; on a CPU
    machine (stream None) a separate buffer. Every offloaded activation part and every ChunkStore chunk
    is made here, one allocation each (costs/host_bytes.py counts them so: pinned ones rounded up)."""
    return t.clone() if stream is None else pinned_copy(t, stream)


class ChunkStore:
    """Tensors of one attention call kept in host memory for its backward, by key: pinned and
    copied on a side stream after the producing kernels on CUDA (a separate buffer on CPU, so the
    path runs in tests); `get` brings one back, `prefetch` starts that copy early on the side stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._kept: dict = {}
        self._ahead: dict = {}  # key -> (device tensor, event) of a prefetch in flight

    def put(self, key, t: torch.Tensor) -> None:
        self._ahead.pop(key, None)
        if self._kept.get(key) is t:  # updated in place (a CPU host chunk)
            return
        self._kept[key] = host_copy(t, self.stream)
        _register_host(self._kept[key])

    def prefetch(self, key) -> None:
        if not self.cuda or key in self._ahead or key not in self._kept:
            return
        with torch.cuda.stream(self.stream):
            dev = self._kept[key].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ahead[key] = (dev, event)

    def get(self, key) -> torch.Tensor:
        t = self._kept[key]
        if not self.cuda:
            return t
        current = torch.cuda.current_stream(self.device)
        if key in self._ahead:
            dev, event = self._ahead.pop(key)
            current.wait_event(event)
            dev.record_stream(current)
            return dev
        current.wait_stream(self.stream)  # a device-to-host copy still running must land first
        return t.to(self.device, non_blocking=True)

    def detach_all(self) -> tuple[dict, torch.device]:
        """Hand over every kept (host) tensor and forget them: (key -> tensor, device); `adopt` takes
        them back (autograd keeps them in between, see _ChunkedAttention)."""
        kept, self._kept, self._ahead = self._kept, {}, {}
        return kept, self.device

    def adopt(self, kept: dict) -> None:
        self._kept.update(kept)

    def has(self, key) -> bool:
        return key in self._kept

    def clear(self) -> None:
        self._kept.clear()
        self._ahead.clear()


# ----------------------------------------------------------------------------------------------
# The two loops


def _fold(acc, out, lse):
    """Merge one pair's (out, lse) into a query chunk's accumulators; the first pair starts them
    (a chunk seen by one key chunk needs no fp32 merge at all)."""
    return (out, lse) if acc is None else merge_partials(acc[0], acc[1], out, lse)


def chunked_forward(q, k, v, grid: ChunkGrid, *, scale=None, backend="flash", emit=None):
    """(out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32) of attention computed chunk pair by
    chunk pair. With `emit(i, out_i, lse_i)` each query chunk's result goes there instead (a ring
    merges it into its accumulators; the single-device core keeps it) and nothing is returned.
    A query chunk that sees no key at all is emitted as None."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    b, sq, h, d = q.shape
    if emit is None:
        out = torch.empty_like(q)
        lse = torch.empty((b, h, sq), dtype=stat_dtype(q), device=q.device)
    for i, qs in enumerate(grid.q_slices):
        qi, acc = q[:, qs], None
        for j in grid.keys_of(i):
            ks = grid.k_slices[j]
            o, l_ = attention_forward(qi, k[:, ks], v[:, ks], causal=grid.causal, scale=scale, backend=backend,
                                      plan=grid.plan(i, j))
            acc = _fold(acc, o, l_)
        if emit is not None:
            emit(i, None if acc is None else acc[0], None if acc is None else acc[1])
        elif acc is None:  # no query of this chunk sees any key
            out[:, qs] = 0
            lse[:, :, qs] = NEG_INF
        else:
            out[:, qs] = acc[0]
            lse[:, :, qs] = acc[1]
    return None if emit is not None else (out, lse)


def chunked_backward(dout, q, k, v, out, lse, grid: ChunkGrid, *, scale=None, backend="flash", dq=None):
    """Gradients (dq, dk, dv) of chunked_forward from the (global) out and lse, key chunks in reverse,
    dk/dv accumulated in fp32 one key chunk at a time and dq per query chunk. With `dq` (an fp32
    accumulator shaped like q, e.g. a ring's) this call's share is added to it and returned."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    fetch = {"q": lambda i: q[:, grid.q_slices[i]], "out": lambda i: out[:, grid.q_slices[i]],
             "lse": lambda i: lse[:, :, grid.q_slices[i]], "dout": lambda i: dout[:, grid.q_slices[i]],
             "k": lambda j: k[:, grid.k_slices[j]], "v": lambda j: v[:, grid.k_slices[j]]}
    given = dq is not None
    if not given:
        dq = torch.zeros(q.shape, dtype=stat_dtype(q), device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _backward_loop(grid, lambda name, i: fetch[name](i), lambda i, g: dq[:, grid.q_slices[i]].add_(g),
                   dk, dv, scale, backend)
    return (dq if given else dq.to(q.dtype)), dk, dv


def _backward_loop(grid: ChunkGrid, get, add_dq, dk, dv, scale, backend, prefetch=None) -> None:
    """The backward over key chunks in reverse: get(name, index) gives a kept chunk ("q", "out",
    "lse", "dout" by query chunk; "k", "v" by key chunk), add_dq(i, g) folds a query chunk's share
    of dq, and dk/dv (whole, in their dtype) receive each key chunk's finished gradients."""
    pairs = [(i, j) for j in reversed(range(len(grid.k_slices))) for i in grid.queries_of(j)]
    for n, (i, j) in enumerate(pairs):
        if prefetch is not None and n + 1 < len(pairs):
            prefetch(*pairs[n + 1])
        if n == 0 or pairs[n - 1][1] != j:  # a new key chunk starts
            kj, vj, gk_acc, gv_acc = get("k", j), get("v", j), None, None
        gq, gk, gv = attention_backward(get("dout", i), get("q", i), kj, vj, get("out", i), get("lse", i),
                                        causal=grid.causal, scale=scale, backend=backend, plan=grid.plan(i, j))
        add_dq(i, gq)
        gk_acc = gk.to(stat_dtype(gk)) if gk_acc is None else gk_acc.add_(gk)
        gv_acc = gv.to(stat_dtype(gv)) if gv_acc is None else gv_acc.add_(gv)
        if n + 1 == len(pairs) or pairs[n + 1][1] != j:  # the key chunk is finished
            ks = grid.k_slices[j]
            dk[:, ks] = gk_acc
            dv[:, ks] = gv_acc
    seen = {j for _, j in pairs}
    for j, ks in enumerate(grid.k_slices):  # keys no query sees get zero gradients
        if j not in seen:
            dk[:, ks] = 0
            dv[:, ks] = 0


# ----------------------------------------------------------------------------------------------
# Single-device core, with the kept chunks in a ChunkStore


class _ChunkedAttention(torch.autograd.Function):
    """Without offload the kept state is saved whole through autograd (so a block's host offloader,
    memory/offload.py, sees it like any other saved tensor); with offload it goes to a ChunkStore
    chunk by chunk and comes back one pair ahead in backward."""

    @staticmethod
    def forward(ctx, q, k, v, grid, offload, scale, backend):
        ctx.grid, ctx.scale, ctx.backend = grid, scale, backend
        if not offload:
            out, lse = chunked_forward(q, k, v, grid, scale=scale, backend=backend)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        store = ChunkStore(q.device)
        for j, ks in enumerate(grid.k_slices):
            store.put(("k", j), k[:, ks])
            store.put(("v", j), v[:, ks])
        for i, qs in enumerate(grid.q_slices):
            store.put(("q", i), q[:, qs])
        out = torch.empty_like(q)

        def keep(i, o, l_):
            qs = grid.q_slices[i]
            if o is None:  # no query of this chunk sees a key
                o = torch.zeros_like(out[:, qs])
                l_ = torch.full((q.shape[0], q.shape[2], qs.stop - qs.start), NEG_INF, dtype=stat_dtype(q),
                                device=q.device)
            out[:, qs] = o
            store.put(("out", i), out[:, qs])
            store.put(("lse", i), l_)

        chunked_forward(q, k, v, grid, scale=scale, backend=backend, emit=keep)
        ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype)
        # The host chunks are saved through autograd: under a checkpoint's first forward (full
        # recomputation) they are dropped at once instead of living until backward
        ctx.keys, ctx.device = store.detach_all()
        ctx.save_for_backward(*ctx.keys.values())
        ctx.keys = list(ctx.keys)
        return out

    @staticmethod
    def backward(ctx, dout):
        grid = ctx.grid
        dout = dout.contiguous()
        if not hasattr(ctx, "keys"):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = chunked_backward(dout, q, k, v, out, lse, grid, scale=ctx.scale, backend=ctx.backend)
            return dq, dk, dv, None, None, None, None
        store = ChunkStore(ctx.device)
        store.adopt(dict(zip(ctx.keys, ctx.saved_tensors)))
        q_shape, q_dtype, k_shape, k_dtype = ctx.shapes
        for i, qs in enumerate(grid.q_slices):
            store.put(("dout", i), dout[:, qs])
        del dout  # only the host copies are kept from here on
        dev = store.device
        dk = torch.empty(k_shape, dtype=k_dtype, device=dev)
        dv = torch.empty(k_shape, dtype=k_dtype, device=dev)

        def add_dq(i, g):  # dq accumulates in fp32 in its host-resident chunk
            key = ("dq", i)
            acc = store.get(key).add_(g) if store.has(key) else g.to(stat_dtype(g))
            store.put(key, acc)

        def prefetch(i, j):
            for name in ("q", "out", "lse", "dout", "dq"):
                store.prefetch((name, i))
            store.prefetch(("k", j))
            store.prefetch(("v", j))

        _backward_loop(grid, lambda name, i: store.get((name, i)), add_dq, dk, dv, ctx.scale, ctx.backend,
                       prefetch=prefetch if store.cuda else None)
        dq = torch.empty(q_shape, dtype=q_dtype, device=dev)
        for i, qs in enumerate(grid.q_slices):
            dq[:, qs] = store.get(("dq", i)) if store.has(("dq", i)) else 0
        store.clear()
        return dq, dk, dv, None, None, None, None


def chunked_attention(q, k, v, grid: ChunkGrid, *, offload: bool = False, scale=None, backend="flash"):
    """Differentiable attention (output only) over the chunk pairs of `grid`; with `offload` the
    kept chunks live in host memory between forward and backward."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _ChunkedAttention.apply(q, k, v, grid, offload, scale, backend)


def chunked_local_attention(q, k, v, doc_ids, *, chunk: int, offload: bool = False):
    """The single-device attention core (models/llama.py's `local_attention`) in chunks of `chunk`."""
    return chunked_attention(q, k, v, local_grid(q.shape[0], q.shape[1], doc_ids, chunk, True), offload=offload)


@dataclass(frozen=True)
class ChunkedLocalCore:
    """The single-device attention core in chunks of `chunk` tokens (memory.attention_chunk) as an
    `Attention.core` value; `offload` keeps its saved state in host memory until backward."""
    chunk: int
    offload: bool = False

    def __call__(self, q, k, v, doc_ids):
        return chunked_local_attention(q, k, v, doc_ids, chunk=self.chunk, offload=self.offload)
