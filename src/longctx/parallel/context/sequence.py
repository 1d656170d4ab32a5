"""Shard / unshard full-sequence tensors by the positions each rank holds (layouts.py).

Tokens, labels, positions and document ids all go through `shard_sequence` (the zigzag layout) or a
`SequenceLayout` (the layout a batch's documents call for), so RoPE positions and document masks
stay attached to their tokens under any layout.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...errors import ConfigError
from ...job import comm
from ...job.checks import check_divisible
from ...ops.chunked import ChunkGrid
from ...ops.segments import plan_pairs, tensor_version
from .doc_balance import docs_balanced_indices
from .layouts import SEQ_BALANCES, check_doc_ids, zigzag_positions


def _degrees(mesh) -> tuple[int, int, int, int]:
    """(ctx, head, ctx_rank, head_rank) of this process in `mesh` (None = one process)."""
    if mesh is None:
        return 1, 1, 0, 0
    ctx, head = comm.sub_mesh(mesh, "ctx"), comm.sub_mesh(mesh, "head")
    return ctx.size(), head.size(), comm.local_rank(ctx), comm.local_rank(head)


def shard_indices(seq_len: int, ctx: int, head: int, ctx_rank: int, head_rank: int) -> torch.Tensor:
    """Global positions of the tokens this rank holds under the zigzag layout, in local order."""
    return torch.from_numpy(zigzag_positions(seq_len, ctx, head)[ctx_rank, head_rank].copy())


def shard_sequence(x: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (identical on all ranks of the head x ctx group)."""
    c, h, i, j = _degrees(mesh)
    if c == h == 1:
        return x
    idx = shard_indices(x.shape[seq_dim], c, h, i, j).to(x.device)
    return x.index_select(seq_dim, idx)


def unshard_sequence(local: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
    """Exact inverse of shard_sequence: every rank gets the full sequence back (communicates)."""
    c, h, _, _ = _degrees(mesh)
    if c == h == 1:
        return local
    gathered = comm.all_gather(local, comm.sub_mesh(mesh, "head"), label="unshard")           # [h, ...]
    gathered = torch.cat(list(gathered.unbind(0)), dim=seq_dim)                # context rank's part
    gathered = comm.all_gather(gathered, comm.sub_mesh(mesh, "ctx"), label="unshard")         # [c, ...]
    gathered = torch.cat(list(gathered.unbind(0)), dim=seq_dim)
    seq_len = local.shape[seq_dim] * c * h
    order = torch.cat([shard_indices(seq_len, c, h, i, j) for i in range(c) for j in range(h)]).to(local.device)
    out = torch.empty_like(gathered)
    return out.index_copy_(seq_dim, order, gathered)


def gather_shards(local: torch.Tensor, mesh, seq_dim: int = 1, label: str = "gather_shards") -> torch.Tensor:
    """Every head x ctx rank's shard of a sequence tensor, concatenated along seq_dim in rank order
    (ctx rank major, head rank minor): the whole sequence, but in an order that is not its own (under
    any layout, zigzag or documents'; unshard_sequence restores that order for the zigzag layout).
    For callers that carry each token's position and document id along and need no more (GliDe's
    cross-attention: train/glide.py). Communicates; no gradient."""
    c, h, _, _ = _degrees(mesh)
    for dim, size in (("head", h), ("ctx", c)):
        if size > 1:
            parts = comm.all_gather(local.contiguous(), comm.sub_mesh(mesh, dim), label=label)
            local = torch.cat(list(parts.unbind(0)), dim=seq_dim)
    return local


# ----------------------------------------------------------------------------------------------
# Layouts that follow the documents


class SequenceLayout:
    """Which global positions every (ctx rank, head rank) holds, per batch row, with the batch's
    document ids on the host.

    Built once per batch by `plan_layout` (a pure function: no communication, no mesh) from the
    full-sequence document ids that every rank already has. It shards tokens, labels, positions and
    document ids alike, and tells ring attention, without any device-to-host transfer, which
    (query segment, key segment) pairs each ring block needs (`block_plan`, cached per step).

    Within a context rank, tokens are in increasing position order; the head ranks hold contiguous
    pieces of that order, so the Ulysses all-to-all reassembles the context rank's tokens in order.
    """

    def __init__(self, positions: np.ndarray, doc_ids: np.ndarray | None, balance: str):
        self.positions = positions  # int64 [batch, ctx, head, seq_local]
        self.doc_ids = doc_ids      # int64 [batch, seq] or None
        self.balance = balance
        self.batch, self.ctx, self.head, self.seq_local = positions.shape
        self.seq_len = self.seq_local * self.ctx * self.head
        self._plans: dict = {}

    def indices(self, ctx_rank: int, head_rank: int) -> torch.Tensor:
        """LongTensor [batch, seq_local]: the global positions this rank holds, in local order."""
        return torch.from_numpy(self.positions[:, ctx_rank, head_rank])

    def ctx_positions(self, ctx_rank: int) -> np.ndarray:
        """[batch, seq_local * head]: a context rank's positions after the all-to-all (head pieces in order)."""
        return self.positions[:, ctx_rank].reshape(self.batch, -1)

    def check(self, seq_len: int, ctx: int, head: int, batch: int | None = None) -> None:
        if (self.seq_len, self.ctx, self.head) != (seq_len, ctx, head) or (batch is not None and batch != self.batch):
            raise ConfigError(
                f"the sequence layout was built for {self.batch} x {self.seq_len} tokens over ctx {self.ctx} x head "
                f"{self.head}, but it is used for {batch if batch is not None else '?'} x {seq_len} tokens over ctx "
                f"{ctx} x head {head}; build it with plan_layout for these tokens and degrees.")

    def shard(self, x: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor [batch, seq, ...] (seq_dim 1)."""
        c, h, i, j = _degrees(mesh)
        if seq_dim != 1:
            raise ValueError("SequenceLayout shards [batch, seq, ...] tensors (seq_dim=1)")
        self.check(x.shape[1], c, h, x.shape[0])
        idx = self.indices(i, j).to(x.device)
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return x[rows, idx]

    def unshard(self, local: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
        """Exact inverse of shard: every rank gets the full sequence back (communicates)."""
        c, h, _, _ = _degrees(mesh)
        if seq_dim != 1:
            raise ValueError("SequenceLayout unshards [batch, seq_local, ...] tensors (seq_dim=1)")
        self.check(local.shape[1] * c * h, c, h, local.shape[0])
        gathered = local
        for dim, size in (("head", h), ("ctx", c)):  # head pieces first: they make a context rank's part
            if size > 1:
                parts = comm.all_gather(gathered, comm.sub_mesh(mesh, dim), label="unshard")
                gathered = torch.cat(list(parts.unbind(0)), dim=1)
        order = torch.from_numpy(self.positions.reshape(self.batch, -1)).to(local.device)
        out = torch.empty_like(gathered)
        rows = torch.arange(local.shape[0], device=local.device)[:, None]
        out[rows, order] = gathered
        return out

    def block_plan(self, q_rank: int, k_rank: int, causal: bool):
        """The segment pairs of context rank q_rank's queries against context rank k_rank's keys."""
        key = (q_rank, k_rank, causal)
        if key not in self._plans:
            qp, kp = self.ctx_positions(q_rank), self.ctx_positions(k_rank)
            rows = np.arange(self.batch)[:, None]
            self._plans[key] = plan_pairs(self.doc_ids[rows, qp], self.doc_ids[rows, kp], causal=causal,
                                          q_pos=qp, k_pos=kp)
        return self._plans[key]

    def chunk_grid(self, q_rank: int, k_rank: int, causal: bool, chunk: int):
        """block_plan's pairs in chunks of `chunk` tokens (memory.attention_chunk, ops/chunked.py)."""
        key = ("chunks", q_rank, k_rank, causal, chunk)
        if key not in self._plans:
            qp, kp = self.ctx_positions(q_rank), self.ctx_positions(k_rank)
            rows = np.arange(self.batch)[:, None]
            self._plans[key] = ChunkGrid(qp, kp, self.doc_ids[rows, qp], self.doc_ids[rows, kp], chunk, causal)
        return self._plans[key]

    @functools.cached_property
    def documents_stay_on_their_rank(self) -> bool:
        """Whether every document of every batch row lies on one context rank's positions (its head ranks'
        pieces together: the rank's tokens after the all-to-all). Then no query needs another rank's keys,
        causal or not, and the ring moves nothing (ring.py: local=True). A pure function of the layout,
        which every rank of the head x ctx group holds whole: every rank decides alike, so none waits on a
        block another skipped. False without documents (one document spans every rank)."""
        if self.doc_ids is None:
            return self.ctx == 1
        owner = np.empty((self.batch, self.seq_len), dtype=np.int64)  # the context rank of every position
        rows = np.arange(self.batch)[:, None]
        for r in range(self.ctx):
            owner[rows, self.ctx_positions(r)] = r
        # documents are contiguous runs (layouts.check_doc_ids): one stays unless a step inside it changes rank
        inside = self.doc_ids[:, 1:] == self.doc_ids[:, :-1]
        return not (inside & (owner[:, 1:] != owner[:, :-1])).any()

    def rank_work(self, causal: bool = True) -> np.ndarray:
        """Visible query-key pairs per context rank (the attention work it does over the whole ring)."""
        return np.array([sum(self.block_plan(i, j, causal).visible() for j in range(self.ctx))
                         for i in range(self.ctx)])


def plan_layout(doc_ids, ctx: int, head: int, *, balance: str = "docs") -> SequenceLayout:
    """The layout of a batch over ctx x head ranks: a pure function of the full-sequence document ids
    [batch, seq] (host array or tensor).

    balance="zigzag" balances a plain causal mask; balance="docs" (parallel.seq_balance), per batch row, each
    context rank's visible (causal, same-document) query-key pairs (doc_balance.py); every rank
    still holds exactly seq / (ctx x head) tokens."""
    if balance not in SEQ_BALANCES:
        raise ConfigError(f"parallel.seq_balance must be one of {SEQ_BALANCES}, got '{balance}'.")
    if doc_ids is None:
        raise ValueError("plan_layout needs the batch's document ids [batch, seq] (for a layout without documents, "
                         "shard with shard_sequence)")
    ids = check_doc_ids(doc_ids)
    batch, seq = ids.shape
    check_divisible(seq, ctx, head)
    if balance == "zigzag" or ctx == 1:
        positions = np.broadcast_to(zigzag_positions(seq, ctx, head), (batch, ctx, head, seq // (ctx * head))).copy()
    else:
        positions = np.stack([docs_balanced_indices(row, ctx, head) for row in ids])
    return SequenceLayout(positions.astype(np.int64), ids, balance)


# A layout travels with the local document-id tensor it was sharded with, so the model (which knows
# nothing about parallelism) passes it to the attention core untouched. It is kept with the tensor's
# version: ids written in place afterwards (a reused buffer) no longer match it, and must not be
# attended with it (the ops' own caches, ops/segments.py and ops/chunked.py, key on the version too).
_LAYOUT_ATTR = "_longctx_layout"


def attach_layout(doc_ids: torch.Tensor, layout: SequenceLayout, *, derived: bool = False) -> torch.Tensor:
    """Let `doc_ids` carry `layout`. derived=True: a layout planned from these ids alone (a cache, which
    `layout_of` forgets once the ids change); otherwise the layout the tokens were sharded with."""
    setattr(doc_ids, _LAYOUT_ATTR, (tensor_version(doc_ids), layout, derived))
    return doc_ids


def layout_of(doc_ids) -> SequenceLayout | None:
    """The layout `doc_ids` carry, None without one (or a derived one the ids have outgrown); a
    ValueError when the ids were written in place after the layout their tokens follow was attached."""
    kept = getattr(doc_ids, _LAYOUT_ATTR, None)
    if kept is None:
        return None
    version, layout, derived = kept
    now = tensor_version(doc_ids)
    if derived:  # a cache: good while the ids are unchanged (an inference tensor's may change unseen)
        return layout if now is not None and now == version else None
    if version == now:
        return layout
    raise ValueError("these document ids were changed in place after their sequence layout was attached "
                     "(attach_layout / local_batch): the layout describes other documents. Give each batch's "
                     "ids a new tensor with its own layout (plan_layout, then attach_layout).")
