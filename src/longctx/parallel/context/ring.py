"""Ring attention over the `ctx` mesh dim, plain or Double-Ring, zigzag-balanced, exact.

Each context rank holds its queries and one key/value block (the zigzag chunks i and 2c-1-i of
the sequence, see sequence.py). Blocks travel around the ring; every rank attends its queries to
every block and merges the partial results with their log-sum-exp in fp32 (fp64 inputs: in fp64,
as the single-device kernels keep them, ops/attention.py stat_dtype; an fp64 run is then a true fp64
reference, not one rounded to fp32 at every merge).

Schedule. The c context ranks form c/w windows of w consecutive ranks (w = `window`, or c for a
plain ring). Outer step o: each rank holds the block of the rank at the same position o windows
back; an inner ring of w - 1 hops passes these blocks around inside the window. The outer transfer
for step o + 1 is started before the inner ring of step o and so hides behind w block
computations instead of one (Double-Ring, LoongTrain). w = c and w = 1 are both the plain ring.
Every transfer is started before the computation that can hide it and waited for only when its
data is needed. Inner hops and outer transfers run on process groups of their own (comm lanes
"ring" and "ring_outer", opened by ParallelDims.build_mesh): on one NCCL communicator the outer
transfer, posted first, would hold up every inner hop queued behind it.

Causal work with the zigzag layout, for query rank i and a block from rank j:
  j == i: causal attention over the local [chunk i, chunk 2c-1-i] (a plain lower triangle);
  j <  i: all queries see the block's early chunk j, none of its late chunk: half the work;
  j >  i: only the late query chunk 2c-1-i sees the block, all of it: half the work.
With packed documents the work follows the documents instead: a host-side SegmentPlan per block
(parallel/context/sequence.py SequenceLayout.block_plan, built once per step from the batch's document
ids and the layout's positions) lists the (query segment, key segment) pairs the block needs; a
block with none is skipped, and no document ids travel around the ring. When every document stays
on one context rank (SequenceLayout.documents_stay_on_their_rank, the same on every rank) no block but
the own one has any pair: the ring is not run at all (local=True), nothing is sent forward or backward.

Backward. dq accumulates locally; the gradient of a block accumulates (in fp32) along the same
path the block took and reaches its owner after c - 1 hops: blocks move c - 1 times, and so do
their gradients.

The merge uses logaddexp, so each weight is exp(lse_part - lse_total) <= 1 (no overflow), and a
row that has seen no key yet (lse = -inf) is handled without NaNs.
"""

from __future__ import annotations

import torch

from ...job import comm
from ...ops.attention import attention_backward, attention_forward, merge_partials, stat_dtype
from ...ops.chunked import ChunkGrid, ChunkStore, chunked_backward, chunked_forward
from .sequence import shard_indices

NEG_INF = float("-inf")
# message tags: several transfers between the same pair of ranks may be in flight at once
TAG_KV, TAG_DKV, TAG_OUTER_KV, TAG_OUTER_DKV = range(4)


class Schedule:
    """Who holds which block when, for context rank `rank` of `ctx` with windows of `window`."""

    def __init__(self, ctx: int, window: int, rank: int):
        if ctx % window:
            raise ValueError(f"window {window} must divide ctx {ctx}")
        self.ctx, self.window, self.rank = ctx, window, rank
        self.windows = ctx // window
        self.win, self.pos = divmod(rank, window)
        self.inner_next, self.inner_prev = self._at(self.win, self.pos + 1), self._at(self.win, self.pos - 1)
        self.outer_next, self.outer_prev = self._at(self.win + 1, self.pos), self._at(self.win - 1, self.pos)

    def _at(self, win: int, pos: int) -> int:
        return (win % self.windows) * self.window + pos % self.window

    def source(self, outer: int, inner: int) -> int:
        """The context rank whose block this rank holds at (outer step, inner step)."""
        return self._at(self.win - outer, self.pos - inner)

    def steps(self):
        for o in range(self.windows):
            for t in range(self.window):
                yield o, t, self.source(o, t)


def block_rows(src: int, rank: int, seq: int, causal: bool):
    """(query rows, key rows, causal?) of the work a block needs under the zigzag layout."""
    everything = slice(0, seq)
    if not causal:
        return everything, everything, False
    half = seq // 2
    if src == rank:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, half), False
    return slice(half, seq), everything, False


def _merge(acc_out, acc_lse, rows, out, lse):
    """Fold a partial (out, lse) for query rows `rows` into the fp32 accumulators, in place."""
    acc_out[:, rows], acc_lse[:, :, rows] = merge_partials(acc_out[:, rows], acc_lse[:, :, rows], out, lse)


def _accumulate(acc, rows, out, lse):
    """Fold one block's (out, lse) into the fp32 accumulators; the first block (which always covers
    every query row) starts them, so no zero-filled merge is ever computed."""
    if acc is None:
        return out.to(stat_dtype(out)), lse
    _merge(acc[0], acc[1], rows, out, lse)
    return acc


def _start_transfer(mesh, kv, to, frm, tag, label):
    """Send kv to `to` and receive the next block from `frm`; returns (pending, buffer)."""
    kv_buf = torch.empty_like(kv)
    return comm.exchange(mesh, [(kv, to, tag)], [(kv_buf, frm, tag)], label=label), kv_buf


def _lanes(mesh):
    """(inner, outer): the 1-D meshes the inner hops and the outer transfers run on. A plain ring
    (or window 1, all hops outer) has one lane for both."""
    inner = comm.lane(mesh, "ring")
    return inner, comm.lane(mesh, "ring_outer", "ring")


def _blocks(mesh, sched: Schedule, k, v, label):
    """(outer step, inner step, source rank, [k, v] block: stacked, or the (k, v) pair itself when there is
    no ring to travel) in schedule order, each transfer started
    before the computation that hides it and waited for only when its block is needed."""
    if sched.ctx == 1:  # no ring: the local block, without the [k, v] copy that travelling needs
        yield 0, 0, 0, (k, v)
        return
    outer_kv = torch.stack([k, v])
    mesh, outer_mesh = _lanes(mesh)
    for o in range(sched.windows):
        last_outer = o == sched.windows - 1
        if not last_outer:
            outer, next_outer = _start_transfer(outer_mesh, outer_kv, sched.outer_next, sched.outer_prev,
                                                TAG_OUTER_KV, label)
        cur = outer_kv
        for t in range(sched.window):
            last_inner = t == sched.window - 1
            if not last_inner:
                inner, nxt = _start_transfer(mesh, cur, sched.inner_next, sched.inner_prev, TAG_KV, label)
            yield o, t, sched.source(o, t), cur
            if not last_inner:
                inner.wait()
                cur = nxt
        if not last_outer:
            outer.wait()
            outer_kv = next_outer


def _ring_of(mesh, window, plans, local):
    """(schedule, this context rank, plans) of one call. local: every document stays on its context rank
    (SequenceLayout.documents_stay_on_their_rank, alike on every rank), so only the rank's own block is
    attended: a ring of one, with no transfer in forward or backward."""
    rank = comm.local_rank(mesh)
    if not local:
        return Schedule(mesh.size(), window or mesh.size(), rank), rank, plans
    if plans is None:
        raise ValueError("ring attention with local=True needs the documents' block plans (plans=): without "
                         "documents every query sees other ranks' keys")
    return Schedule(1, 1, 0), rank, lambda _src: plans(rank)


def ring_forward(q, k, v, mesh, window, causal, scale, backend, plans=None, local=False):
    """Forward over the context group: returns (out in q's dtype, lse fp32 [b, h, s]; fp64 for fp64 q).

    plans: None (no documents: zigzag block rows) or a function source rank -> SegmentPlan, or ->
    ChunkGrid when the attention core runs in chunks (memory.attention_chunk, ops/chunked.py).
    local: the documents stay on their ranks: the own block only, nothing sent (_ring_of)."""
    sched, rank, plans = _ring_of(mesh, window, plans, local)
    s = q.shape[1]
    acc = None  # (out, lse) in fp32 (fp64 for fp64 q), started by the first block, which always covers every query row
    if plans is not None:  # with documents no block need cover every row: start from nothing
        acc = (torch.zeros(q.shape, dtype=stat_dtype(q), device=q.device),
               torch.full((q.shape[0], q.shape[2], s), NEG_INF, dtype=stat_dtype(q), device=q.device))
    for _, _, src, kv in _blocks(mesh, sched, k, v, "ring_kv"):
        if plans is None:
            qr, kr, blk_causal = block_rows(src, rank, s, causal)
            out, lse = attention_forward(q[:, qr], kv[0][:, kr], kv[1][:, kr], causal=blk_causal, scale=scale,
                                         backend=backend)
            acc = _accumulate(acc, qr, out, lse)
            continue
        plan = plans(src)
        if isinstance(plan, ChunkGrid):  # memory.attention_chunk: the block in chunk pairs, merged per chunk
            chunked_forward(q, kv[0], kv[1], plan, scale=scale, backend=backend,
                            emit=lambda i, o, l_, g=plan, a=acc: o is None or _merge(a[0], a[1], g.q_slices[i], o, l_))
        elif not plan.empty:
            out, lse = attention_forward(q, kv[0], kv[1], causal=causal, scale=scale, backend=backend, plan=plan)
            _merge(acc[0], acc[1], slice(0, s), out, lse)
    return acc[0].to(q.dtype), acc[1]


def ring_backward(dout, q, k, v, out, lse, mesh, window, causal, scale, backend, plans=None, local=False):
    """Gradients (dq, dk, dv) of ring_forward; dk/dv arrive back at their owner in fp32, then cast.
    local: as ring_forward's, the own block's gradients only, nothing sent."""
    sched, rank, plans = _ring_of(mesh, window, plans, local)
    # fp32; without documents the first block (which covers every query row) starts it
    dq = None if plans is None else torch.zeros(q.shape, dtype=stat_dtype(q), device=q.device)
    in_flight: list[comm.Pending] = []  # sends we must see complete before returning
    inner_mesh, outer_mesh = _lanes(mesh)
    own_total = None
    outer_acc = None  # (pending, buffer) of the outer gradient accumulator arriving from outer_prev
    hold = inner_acc = None
    for o, t, src, kv in _blocks(mesh, sched, k, v, "ring_kv_bwd"):
        if t == 0:
            hold = None       # this rank's own contribution to its outer block
            inner_acc = None  # (pending, buffer) of the inner accumulator arriving from inner_prev
        plan = None if plans is None else plans(src)
        dq, dkv = _block_backward(dout, q, kv, out, lse, src, rank, causal, scale, backend, dq, plan)
        if t == 0:
            hold = dkv
        else:
            inner_acc = _pass_on(inner_mesh, dkv, inner_acc, sched.inner_next, sched.inner_prev, TAG_DKV,
                                 in_flight)
        if t < sched.window - 1:
            continue
        hold = _settle(hold, inner_acc)  # the last hop brought back the window's gradient of our outer block
        if o == 0:
            own_total = hold
        else:
            outer_acc = _pass_on(outer_mesh, hold, outer_acc, sched.outer_next, sched.outer_prev, TAG_OUTER_DKV,
                                 in_flight)
    own_total = _settle(own_total, outer_acc)
    for pending in in_flight:
        pending.wait()
    return dq.to(q.dtype), own_total[0].to(k.dtype), own_total[1].to(v.dtype)


def _settle(acc, incoming):
    """acc plus the accumulator `incoming` = (pending, buffer) once it has arrived (if any)."""
    if incoming is None:
        return acc
    incoming[0].wait()
    return acc + incoming[1]


def _pass_on(mesh, acc, incoming, to, frm, tag, in_flight):
    """Add the gradient accumulator arriving from `frm` (if any) to `acc`, send the sum on to `to`,
    and post the receive of the next accumulator from `frm`; returns it as (pending, buffer)."""
    acc = _settle(acc, incoming)
    buf = torch.empty_like(acc)
    pending = comm.exchange(mesh, [(acc, to, tag)], [(buf, frm, tag)], label="ring_dkv")
    in_flight.append(pending)
    return pending, buf


def _block_backward(dout, q, kv, out, lse, src, rank, causal, scale, backend, dq, plan=None):
    """One block's gradients: returns (dq with this block's share added, the block's [dk, dv] in fp32).

    Without a plan, `dq` may be None before the first block, which covers every query row and so
    starts it. With a plan (documents), only its segment pairs are computed; an empty plan costs nothing.
    Accumulators are fp32 (fp64 for fp64 inputs: stat_dtype)."""
    stat = stat_dtype(q)
    if isinstance(plan, ChunkGrid):
        dq, gk, gv = chunked_backward(dout, q, kv[0], kv[1], out, lse, plan, scale=scale, backend=backend, dq=dq)
        return dq, torch.stack([gk, gv]).to(stat)
    if plan is not None:
        if plan.empty:
            return dq, torch.zeros((2, *kv[0].shape), dtype=stat, device=kv[0].device)
        gq, gk, gv = attention_backward(dout, q, kv[0], kv[1], out, lse, causal=causal, scale=scale,
                                        backend=backend, plan=plan)
        dq += gq.to(stat)
        return dq, torch.stack([gk, gv]).to(stat)
    s = q.shape[1]
    qr, kr, blk_causal = block_rows(src, rank, s, causal)
    gq, gk, gv = attention_backward(dout[:, qr], q[:, qr], kv[0][:, kr], kv[1][:, kr], out[:, qr],
                                    lse[:, :, qr], causal=blk_causal, scale=scale, backend=backend)
    if dq is None:
        dq = gq.to(stat)
    else:
        dq[:, qr] += gq.to(stat)
    if kr == slice(0, s):
        return dq, torch.stack([gk, gv]).to(stat)
    dkv = torch.zeros((2, *kv[0].shape), dtype=stat, device=kv[0].device)
    dkv[0][:, kr] = gk
    dkv[1][:, kr] = gv
    return dq, dkv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, window, causal, scale, backend, plans, offload, local):
        out, lse = ring_forward(q, k, v, mesh, window, causal, scale, backend, plans, local)
        if offload:  # memory.attention_offload: the kept state waits in host memory for backward
            store = ChunkStore(q.device)
            for name, t in zip(_KEPT, (q, k, v, out, lse)):
                store.put(name, t)
            kept, ctx.device = store.detach_all()
            ctx.save_for_backward(*(kept[name] for name in _KEPT))  # dropped at once under a checkpoint
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.offload = offload
        ctx.args = (mesh, window, causal, scale, backend, plans, local)
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.offload:
            store = ChunkStore(ctx.device)
            store.adopt(dict(zip(_KEPT, ctx.saved_tensors)))
            q, k, v, out, lse = (store.get(name) for name in _KEPT)
        else:
            q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


_KEPT = ("q", "k", "v", "out", "lse")


def ring_attention(q, k, v, mesh, *, window=0, causal=True, scale=None, backend="flash", plans=None,
                   offload=False, local=False):
    """Differentiable ring attention over the 1-D context mesh; q/k/v are this rank's shards (zigzag,
    or the layout `plans` was built for: a function source context rank -> SegmentPlan or ChunkGrid).
    offload: keep q, k, v, out and lse in host memory between forward and backward. local: every
    document stays on its context rank (SequenceLayout.documents_stay_on_their_rank; it must be the same
    on every rank of the ring): only the own block is attended, and nothing travels."""
    return RingAttention.apply(q, k, v, mesh, window, causal, scale, backend, plans, offload, local)


def simulate_ring(q, k, v, ctx: int, window: int = 0, causal: bool = True, scale=None, backend="flash",
                  dout=None):
    """Every context rank's block schedule run in ONE process, without communication.

    q, k, v are full-sequence tensors; they are cut into the zigzag shards of `ctx` ranks, each
    rank's blocks are computed and merged exactly as ring_forward / ring_backward do, and the
    per-rank results are returned as lists (out, lse, and with `dout` also dq, dk, dv, where dk/dv
    are summed over all ranks' contributions to each owner's block). Used to measure the compute
    overhead of the block schedule against one attention call (on one GPU or one CPU process), and
    to test the schedule without processes.
    """
    seq = q.shape[1]
    idx = [shard_indices(seq, ctx, 1, i, 0).to(q.device) for i in range(ctx)]
    qs, ks, vs = ([t.index_select(1, i) for i in idx] for t in (q, k, v))
    douts = None if dout is None else [dout.index_select(1, i) for i in idx]
    results = []
    for rank in range(ctx):
        sched = Schedule(ctx, window or ctx, rank)
        s = qs[rank].shape[1]
        acc = None
        for _, _, src in sched.steps():
            qr, kr, blk_causal = block_rows(src, rank, s, causal)
            out, lse = attention_forward(qs[rank][:, qr], ks[src][:, kr], vs[src][:, kr], causal=blk_causal,
                                         scale=scale, backend=backend)
            acc = _accumulate(acc, qr, out, lse)
        results.append((acc[0].to(q.dtype), acc[1]))
    if douts is None:
        return [r[0] for r in results], [r[1] for r in results]
    dqs, dks = [], [torch.zeros((2, *ks[i].shape), dtype=stat_dtype(q), device=q.device) for i in range(ctx)]
    for rank in range(ctx):
        sched = Schedule(ctx, window or ctx, rank)
        dq = None
        out, lse = results[rank]
        for _, _, src in sched.steps():
            dq, dkv = _block_backward(douts[rank], qs[rank], torch.stack([ks[src], vs[src]]), out, lse, src, rank,
                                      causal, scale, backend, dq)
            dks[src] += dkv
        dqs.append(dq.to(q.dtype))
    return ([r[0] for r in results], [r[1] for r in results], dqs, [d[0].to(k.dtype) for d in dks],
            [d[1].to(v.dtype) for d in dks])
