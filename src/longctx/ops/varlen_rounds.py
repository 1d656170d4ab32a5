"""Rounds: the host-side description of the varlen kernel calls of one SegmentPlan (varlen.py).

All pairs of a round share the causal flag and no query row appears in two pairs of one round, so
each round is one varlen call that writes each of its query rows once. Built once per plan on the
host (numpy) and kept on the plan; index tensors go to each device once, asynchronously.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .segments import SegmentPlan


@dataclass
class VarlenRound:
    """One varlen kernel call: `len(cu_seqlens_q) - 1` (query segment, key segment) sequences.

    q_index / k_index: flat token rows gathered for the call, sequence after sequence (int64);
    cu_seqlens_*: int32 offsets of each sequence in them, starting at 0; the query rows of one round
    are all different. q_identity / k_identity: the index is every row of the block in order, so
    the call reads the flat tensor itself (no gather)."""

    causal: bool
    pairs: np.ndarray  # indices of the plan's pairs, in call order
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_identity: bool
    k_identity: bool

    @property
    def num_seqs(self) -> int:
        return len(self.pairs)


@dataclass
class _DeviceRound:
    causal: bool
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_identity: bool
    k_identity: bool


@dataclass
class VarlenPlan:
    """The rounds of one SegmentPlan, with their index tensors cached per device."""

    rounds: list[VarlenRound]
    num_q_rows: int
    num_k_rows: int
    multi: bool  # some query row is in more than one round: merge with the lse
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> list[_DeviceRound]:
        """The rounds with their index tensors on `device`: copied once, host to device, without a sync."""
        device = torch.device(device)
        cached = self._on.get(device)
        if cached is not None:
            return cached[0]
        if not self.rounds:
            self._on[device] = ([], None)
            return []
        # Two transfers per plan and device: every index in one int64 buffer, every offset in one int32.
        longs = torch.cat([t for r in self.rounds for t in (r.q_index, r.k_index)])
        ints = torch.cat([t for r in self.rounds for t in (r.cu_seqlens_q, r.cu_seqlens_k)])
        if device.type == "cuda":
            longs, ints = longs.pin_memory(), ints.pin_memory()  # keeps the async copy truly async
        if device.type != "cpu":
            dev_longs = longs.to(device, non_blocking=True)
            dev_ints = ints.to(device, non_blocking=True)
        else:
            dev_longs, dev_ints = longs, ints
        out, lo, io = [], 0, 0
        for r in self.rounds:
            nq, nk, nc = len(r.q_index), len(r.k_index), len(r.cu_seqlens_q)
            out.append(_DeviceRound(r.causal, dev_longs[lo:lo + nq], dev_longs[lo + nq:lo + nq + nk],
                                    dev_ints[io:io + nc], dev_ints[io + nc:io + 2 * nc],
                                    r.max_seqlen_q, r.max_seqlen_k, r.q_identity, r.k_identity))
            lo, io = lo + nq + nk, io + 2 * nc
        # The pinned host buffers stay referenced until the plan goes: the copies read them asynchronously.
        self._on[device] = (out, (longs, ints))
        return out


def varlen_rounds(plan: SegmentPlan) -> VarlenPlan:
    """The varlen calls that execute `plan`, built once and kept on the plan object."""
    cached = getattr(plan, "_longctx_varlen", None)
    if cached is None:
        cached = _build_rounds(plan)
        plan._longctx_varlen = cached
    return cached


def _build_rounds(plan: SegmentPlan) -> VarlenPlan:
    nq_rows, nk_rows = plan.batch * plan.seq_q, plan.batch * plan.seq_k
    rounds: list[VarlenRound] = []
    for causal in (True, False):
        sel = np.flatnonzero(plan.causal == causal)
        if len(sel) == 0:
            continue
        if causal and not np.array_equal(plan.q_len[sel], plan.k_len[sel]):
            raise ValueError("causal segment pairs must be square (same span of queries and keys)")
        # Rank of each pair among the pairs of its query segment (segments are disjoint, so a query
        # segment is named by its start): round r of this kind takes every segment's r-th pair.
        qs = plan.q_start[sel]
        order = np.lexsort((sel, qs))
        sorted_qs = qs[order]
        first = np.concatenate([[True], sorted_qs[1:] != sorted_qs[:-1]])
        pos = np.arange(len(order))
        rank = pos - np.maximum.accumulate(np.where(first, pos, 0))
        for r in range(int(rank.max()) + 1):
            rounds.append(_make_round(plan, sel[order[rank == r]], causal, nq_rows, nk_rows))
    return VarlenPlan(rounds, nq_rows, nk_rows, multi=bool(plan.multi))


def _segment_rows(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cu offsets int64 [n + 1], rows int64 [sum lengths]) of segments laid end to end."""
    cu = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    rows = np.repeat(starts - cu[:-1], lengths) + np.arange(cu[-1], dtype=np.int64)
    return cu, rows


def _is_identity(starts: np.ndarray, lengths: np.ndarray, total_rows: int) -> bool:
    """Whether the segments, in this order, are exactly rows 0 .. total_rows - 1."""
    if int(lengths.sum()) != total_rows or len(starts) == 0 or starts[0] != 0:
        return False
    return bool(np.all(starts[1:] == starts[:-1] + lengths[:-1]))


def _make_round(plan: SegmentPlan, pairs: np.ndarray, causal: bool, nq_rows: int, nk_rows: int) -> VarlenRound:
    qs, ql = plan.q_start[pairs], plan.q_len[pairs]  # pairs come sorted by query start
    ks, kl = plan.k_start[pairs], plan.k_len[pairs]
    if np.any(qs[1:] < qs[:-1] + ql[:-1]):
        raise AssertionError("a varlen round would write one query row twice")
    cu_q, q_rows = _segment_rows(qs, ql)
    cu_k, k_rows = _segment_rows(ks, kl)
    if cu_q[-1] >= 2 ** 31 or cu_k[-1] >= 2 ** 31:
        raise ValueError("a varlen round holds more than 2^31 tokens; int32 offsets cannot describe it")
    return VarlenRound(
        causal=causal,
        pairs=pairs,
        q_index=torch.from_numpy(q_rows),
        k_index=torch.from_numpy(k_rows),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)),
        max_seqlen_q=int(ql.max()),
        max_seqlen_k=int(kl.max()),
        q_identity=_is_identity(qs, ql, nq_rows),
        k_identity=_is_identity(ks, kl, nk_rows),
    )
