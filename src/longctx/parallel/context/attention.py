"""2D sequence-parallel attention: Ulysses all-to-all over `head` around ring attention over `ctx`.

    q, k, v  [b, S/(h c), heads, d]          this rank's zigzag shard (sequence.shard_sequence)
      -- all-to-all over head -->  [b, S/c, heads/h, d]   the context rank's part, a head slice
      -- ring over ctx ---------->  attention against every block of the context group
      -- all-to-all over head -->  out [b, S/(h c), heads, d]

Each ring step then computes h times more attention per byte moved than a pure ring over h x c
ranks would (LoongTrain's argument for 2D). Either degree may be 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError
from ...job import comm
from ...job.checks import check_heads
from ...ops.chunked import ChunkGrid, chunked_attention
from ...ops.segments import host_ids
from .ring import ring_attention
from .sequence import SequenceLayout, attach_layout, layout_of, plan_layout, shard_indices, unshard_sequence
from .ulysses import head_to_seq, kv_replication, seq_to_head


def check_inputs(q, k, v, doc_ids, head: int, ctx: int, window: int) -> None:
    """Every shape and degree problem, reported before any communication."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"distributed_attention expects q [b, s, heads, d] and k, v [b, s, kv_heads, d]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must share batch, sequence and head_dim")
    if not (q.shape[2] and k.shape[2]):
        raise ValueError(f"distributed_attention needs at least one query head and one key/value head; got q "
                         f"{tuple(q.shape)} and k/v {tuple(k.shape)} ([batch, local_seq, heads, head_dim]).")
    check_heads(q.shape[2], k.shape[2], head)
    local = q.shape[1]
    if local % 2:
        seq, unit = local * head * ctx, 2 * ctx * head
        fits = " or ".join(str(n) for n in sorted({seq - seq % unit or unit, seq - seq % unit + unit}))
        raise ConfigError(
            f"sequence length {seq} (a local shard of {local} tokens on each of head x ctx = {head} x {ctx} ranks) "
            f"is not divisible by 2 x ctx x head = {unit}: the zigzag layout needs an even number of tokens per "
            f"shard. Use {fits} tokens (pad explicitly and mask the padding out of the "
            f"loss), sharded with shard_sequence or a plan_layout layout."
        )
    if window < 0 or (window and ctx % window):
        raise ConfigError(f"window {window} must be 0 (plain ring) or divide the context-parallel degree {ctx}.")
    if doc_ids is not None and tuple(doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"doc_ids must be shaped like the tokens [batch, local_seq] = {tuple(q.shape[:2])}, "
                         f"got {tuple(doc_ids.shape)}; shard them with shard_sequence like the tokens.")



def distributed_attention(q, k, v, mesh, *, causal=True, doc_ids=None, scale=None, window=0, backend="flash",
                          layout: SequenceLayout | None = None, attention_chunk: int = 0,
                          attention_offload: bool = False, on_kv=None):
    """Exact attention over the sequence sharded across the head x ctx ranks of `mesh`.

    q, k, v: this rank's shards [batch, local_seq, heads, head_dim] (k, v with kv heads), in the
    zigzag layout of `shard_sequence` or in `layout` (sequence.plan_layout). doc_ids: [batch, local_seq]
    document ids sharded the same way (None = one document). With documents, the layout (given,
    attached to doc_ids by the training loop, or else built here once from the gathered ids) tells
    every ring block which segment pairs it needs, on the host. attention_chunk > 0: every ring
    block is computed in chunk pairs of that many tokens (ops/chunked.py), so the attention
    kernels' working set is one chunk pair; attention_offload keeps the ring's saved state (q, k, v,
    out, lse) in host memory until backward. on_kv(k, v), when given, sees the keys and values this
    rank attends with after the head all-to-all ([batch, S/ctx, kv heads of its head slice, d], the
    context rank's positions: what a sharded KV cache keeps after a prefill). Returns this rank's
    output shard, shaped like q; differentiable.
    """
    head_mesh, ctx_mesh = comm.sub_mesh(mesh, "head"), comm.sub_mesh(mesh, "ctx")
    h, c = head_mesh.size(), ctx_mesh.size()
    check_inputs(q, k, v, doc_ids, h, c, window)
    plans, local = None, False
    attached = None if doc_ids is None else layout_of(doc_ids)
    # (ids without a layout are checked once gathered, in plan_layout, alike on every rank: a check of
    # this rank's shard alone failed on the one rank whose shard showed the fault, while the others
    # waited in the gather for it)
    if doc_ids is not None or layout is not None:
        given = layout is not None and layout is not attached
        layout = layout or attached or _zigzag_layout_of(doc_ids, mesh)
        layout.check(q.shape[1] * h * c, c, h, q.shape[0])
        me = comm.local_rank(ctx_mesh)
        if given and doc_ids is not None:  # the ring follows the layout's documents: they must be these
            _check_ids_follow(layout, doc_ids, ctx_mesh, head_mesh)
        plans = lambda src: _block_plan(layout, me, causal, attention_chunk, src)  # noqa: E731
        # every document on one context rank: no ring transfer at all (decided alike on every rank:
        # the layout is the whole group's)
        local = c > 1 and layout.documents_stay_on_their_rank
    elif attention_chunk:
        batch, seq, me = q.shape[0], q.shape[1] * h * c, comm.local_rank(ctx_mesh)
        plans = lambda src: _zigzag_grid(batch, seq, c, me, causal, attention_chunk, src)  # noqa: E731
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    r = kv_replication(k.shape[2], h)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    q, k, v = (seq_to_head(t, head_mesh) for t in (q, k, v))
    if on_kv is not None:
        on_kv(k, v)
    if attention_chunk and c == 1:
        # no ring: the chunked core with its state chunk by chunk (in host memory with offload), as on
        # one device, over the head group's whole sequence (FPDT's Ulysses + chunks)
        out = chunked_attention(q, k, v, plans(0), offload=attention_offload, scale=scale, backend=backend)
    else:
        out = ring_attention(q, k, v, ctx_mesh, window=window, causal=causal, scale=scale, backend=backend,
                             plans=plans, offload=attention_offload, local=local)
    return head_to_seq(out, head_mesh)


def _block_plan(layout: SequenceLayout, me: int, causal: bool, chunk: int, src: int):
    return layout.chunk_grid(me, src, causal, chunk) if chunk else layout.block_plan(me, src, causal)


@functools.lru_cache(maxsize=64)
def _zigzag_grid(batch: int, seq: int, ctx: int, me: int, causal: bool, chunk: int, src: int) -> ChunkGrid:
    """Without documents: the chunk pairs of context rank `me`'s queries against `src`'s keys in the
    zigzag layout (a context rank's tokens after the head all-to-all: shard_indices with head 1)."""
    qp, kp = (np.broadcast_to(shard_indices(seq, ctx, 1, r, 0).numpy(), (batch, seq // ctx)) for r in (me, src))
    return ChunkGrid(qp, kp, None, None, chunk, causal)


def _check_ids_follow(layout: SequenceLayout, doc_ids: torch.Tensor, ctx_mesh, head_mesh) -> None:
    """A layout given beside doc_ids is what the ring attends by: refuse ids that are not its own at this
    rank's positions (other documents, or ids sharded another way), before the attention communicates.
    Every rank of the head x ctx group learns where the first fault is (one small control all-reduce,
    not byte-counted) and raises the same error: a fault in one rank's ids alone used to stop that rank
    while the others waited for it in the all-to-all or the ring. The same table carries a fingerprint of
    each rank's layout: layouts that differ between ranks (each rank's ids their own layout's) attended
    by different masks, and now could decide differently whether the ring runs at all
    (documents_stay_on_their_rank) and hang. Once checked, the ids carry the layout, so the model's other
    layers do not check again."""
    ctx_rank, head_rank = comm.local_rank(ctx_mesh), comm.local_rank(head_mesh)
    expected = layout.doc_ids[np.arange(layout.batch)[:, None], layout.positions[:, ctx_rank, head_rank]]
    got = host_ids(doc_ids)
    faults = torch.zeros(ctx_mesh.size() * head_mesh.size(), 6, dtype=torch.int64)
    mine = ctx_rank * head_mesh.size() + head_rank
    faults[mine, 5] = _layout_fingerprint(layout)
    rows, cols = np.nonzero(got != expected)
    if len(rows):  # (this rank's row of the table: 1, batch row, local token, the ids' document, the layout's)
        r, c = int(rows[0]), int(cols[0])
        faults[mine, :5] = torch.tensor([1, r, c, int(got[r, c]), int(expected[r, c])])
    faults = faults.to(doc_ids.device)
    for mesh in (head_mesh, ctx_mesh):
        if mesh.size() > 1:
            comm.all_reduce_in_group(faults, comm.group_of(mesh))
    faults = faults.cpu()
    if not bool((faults[:, 5] == faults[0, 5]).all()):
        differ = torch.nonzero(faults[:, 5] != faults[0, 5]).flatten().tolist()
        raise ValueError(
            f"the sequence layouts given with doc_ids differ between the ranks of the head x ctx group (the layouts "
            f"of group ranks {differ} are not rank 0's): every rank must pass the one layout planned from the whole "
            f"batch's ids (plan_layout on the same ids everywhere), which the ring attends by.")
    bad = torch.nonzero(faults[:, 0]).flatten()
    if len(bad):
        i = int(bad[0])
        at_ctx, at_head = divmod(i, head_mesh.size())
        _, r, c, said, wanted = (int(x) for x in faults[i, :5])
        raise ValueError(
            f"doc_ids do not match the sequence layout given with them: on context rank {at_ctx}, head rank "
            f"{at_head} ({len(bad)} of the {len(faults)} ranks' ids differ), at batch row {r}, local token {c} "
            f"(global position {layout.positions[r, at_ctx, at_head, c]}) the ids say document {said}, the layout "
            f"{wanted}. Shard the ids with layout.shard like the tokens, and plan the layout from the same batch's "
            f"ids.")
    attach_layout(doc_ids, layout, derived=True)


def _layout_fingerprint(layout: SequenceLayout) -> int:
    """A checksum of what the ring attends by (positions, documents, the degrees), equal on ranks that hold the
    same layout (a non-negative int64)."""
    ids = b"" if layout.doc_ids is None else np.ascontiguousarray(layout.doc_ids, dtype=np.int64).tobytes()
    shape = np.array([layout.batch, layout.ctx, layout.head], dtype=np.int64).tobytes()
    return zlib.crc32(np.ascontiguousarray(layout.positions, dtype=np.int64).tobytes() + ids + shape)


def _zigzag_layout_of(doc_ids: torch.Tensor, mesh) -> SequenceLayout:
    """Without a layout: gather the document ids once (one all-gather and one copy to the host per
    call) and plan on the zigzag layout they were sharded with; kept on doc_ids for the next layers."""
    # as int64, whatever integer type the ids have: the collectives take no int16 (gloo, NCCL), and the
    # bytes are volumes.attention_bytes' (DOC_ID_BYTES)
    full = unshard_sequence(doc_ids.to(torch.int64).contiguous(), mesh)
    layout = plan_layout(full.cpu(), mesh["ctx"].size(), mesh["head"].size(), balance="zigzag")
    attach_layout(doc_ids, layout, derived=True)  # planned from these ids: forgotten if they change
    return layout


@dataclass(frozen=True)
class SequenceParallelCore:
    """An attention core (models/llama.py's `Attention.core`, the model's one attention hook) that is
    2D sequence-parallel causal attention over `mesh`'s head x ctx ranks (`distributed_attention`);
    `chunked` gives the same core run in chunks of attention_chunk tokens per ring block. A named
    value rather than a partial, so that a reader (and `chunked_core`) can see which core a block has."""
    mesh: object
    window: int
    attention_chunk: int = 0
    attention_offload: bool = False

    def __call__(self, q, k, v, doc_ids):
        return distributed_attention(q, k, v, self.mesh, causal=True, doc_ids=doc_ids, window=self.window,
                                     attention_chunk=self.attention_chunk, attention_offload=self.attention_offload)

    def chunked(self, chunk: int, offload: bool) -> SequenceParallelCore:
        return dataclasses.replace(self, attention_chunk=chunk, attention_offload=offload)
