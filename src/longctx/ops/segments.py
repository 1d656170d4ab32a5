"""The document-sparse structure of packed attention, computed on the host from document ids.

A packed sequence holds several documents and a query may only see keys of its own document
(and, causally, not later ones). Documents are contiguous runs of tokens, so that structure is a
short list of (query segment, key segment) pairs instead of a [S_q, S_k] mask:

- a *segment* is a maximal run of tokens with one document id and consecutive global positions;
- a *pair* joins a query segment and a key segment of the same document; under a causal mask it is
  `full` when every key precedes every query, `causal` when both are the same span (a lower
  triangle), and dropped when every key comes after every query.

Attention then runs per pair (ops/attention.py), so its time and memory follow the documents:
sum over documents of L^2 instead of S^2, and no S_q x S_k tensor anywhere. Pairs of equal shape
are batched into one kernel call (4,000 documents of 8 tokens are one call, not 4,000).

Token offsets are flat: row r, position i of a [batch, seq] tensor is r * seq + i. Plans are
numpy on the host: built once per batch (or per ring block) from host-side document ids, so the
device never waits for the host to learn where documents are.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PairGroup:
    """Pairs of one shape, run as one batched kernel call."""

    q_len: int
    k_len: int
    causal: bool
    q_start: np.ndarray  # [n] flat token offsets
    k_start: np.ndarray  # [n]

    def __len__(self) -> int:
        return len(self.q_start)


@dataclass
class SegmentPlan:
    """Every visible (query segment, key segment) pair of a [batch, seq_q] x [batch, seq_k] block."""

    batch: int
    seq_q: int
    seq_k: int
    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray
    causal: np.ndarray  # bool per pair
    multi: bool  # some query row is covered by more than one pair (its results must be merged)
    groups: list[PairGroup] = field(default_factory=list)

    @property
    def num_pairs(self) -> int:
        return len(self.q_start)

    @property
    def empty(self) -> bool:
        return self.num_pairs == 0

    def visible(self) -> int:
        """Query-key pairs that attend: the work of this block (a causal pair counts its triangle)."""
        full = (self.q_len * self.k_len)[~self.causal].sum()
        tri = (self.q_len * (self.q_len + 1) // 2)[self.causal].sum()
        return int(full + tri)



def segments(doc: np.ndarray, pos: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of one document id (and consecutive positions) in a 1-D row: (starts, lengths, doc ids)."""
    n = len(doc)
    if n == 0:
        return (np.zeros(0, dtype=np.int64),) * 3
    cut = doc[1:] != doc[:-1]
    if pos is not None:
        cut |= pos[1:] != pos[:-1] + 1
    starts = np.concatenate([[0], np.flatnonzero(cut) + 1]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n]])).astype(np.int64)
    return starts, lengths, doc[starts]


def tensor_version(t: torch.Tensor) -> int | None:
    """t's in-place write counter, what the caches kept on document-id tensors are keyed on; None for an
    inference tensor (torch.inference_mode), which tracks none: nothing may be cached on it."""
    try:
        return t._version
    except RuntimeError:
        return None


def keep_host_copy(ids: torch.Tensor, host: torch.Tensor) -> None:
    """Let `ids` (document ids moved to the device) carry their host copy, so that plans built from
    them in the step (here, ops/chunked.py) read no device data."""
    ids._longctx_host = (tensor_version(ids), host.detach().cpu().numpy())


def host_ids(ids: torch.Tensor) -> np.ndarray:
    """The ids as a host array: the copy kept by keep_host_copy while `ids` is unchanged, else a
    device-to-host copy (a sync on CUDA)."""
    kept = getattr(ids, "_longctx_host", None)
    version = tensor_version(ids)
    return kept[1] if kept is not None and version is not None and kept[0] == version else ids.detach().cpu().numpy()


def _as_numpy(x) -> np.ndarray | None:
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = host_ids(x)
    return np.asarray(x, dtype=np.int64)


def plan_pairs(q_doc, k_doc, *, causal: bool, q_pos=None, k_pos=None) -> SegmentPlan:
    """The visible segment pairs of queries with document ids `q_doc` [batch, seq_q] against keys
    `k_doc` [batch, seq_k] (host arrays or CPU tensors).

    q_pos / k_pos: global positions [batch, seq] (increasing along each row), needed for a causal
    mask between different token sets (ring blocks). Without them a causal block is the square
    diagonal block: queries and keys are the same tokens.
    """
    q_doc, k_doc, q_pos, k_pos = (_as_numpy(x) for x in (q_doc, k_doc, q_pos, k_pos))
    if q_doc.ndim != 2 or k_doc.ndim != 2 or q_doc.shape[0] != k_doc.shape[0]:
        raise ValueError(f"document ids must be [batch, seq] for queries and keys with one batch, got "
                         f"{q_doc.shape} and {k_doc.shape}")
    b, sq = q_doc.shape
    sk = k_doc.shape[1]
    if causal and q_pos is None:
        if sq != sk:
            raise ValueError(f"causal attention without positions needs as many queries as keys, got {sq} and {sk}")
        q_pos = k_pos = np.broadcast_to(np.arange(sq, dtype=np.int64), (b, sq))
    cols: list[list[int]] = [[], [], [], [], []]  # q_start, q_len, k_start, k_len, causal
    multi = False
    for r in range(b):
        qs, ql, qd = segments(q_doc[r], None if q_pos is None else q_pos[r])
        ks, kl, kd = segments(k_doc[r], None if k_pos is None else k_pos[r])
        if q_pos is None or q_pos is k_pos:
            _check_contiguous(qd, r)
        by_doc: dict[int, list[int]] = {}
        for j, d in enumerate(kd.tolist()):
            by_doc.setdefault(d, []).append(j)
        for i, d in enumerate(qd.tolist()):
            found = 0
            for j in by_doc.get(d, ()):
                kind = _relation(qs[i], ql[i], ks[j], kl[j], q_pos[r] if causal else None,
                                 k_pos[r] if causal else None)
                if kind is None:
                    continue
                found += 1
                for col, value in zip(cols, (r * sq + qs[i], ql[i], r * sk + ks[j], kl[j], kind)):
                    col.append(value)
            multi |= found > 1
    arrays = [np.asarray(c, dtype=np.int64) for c in cols[:4]] + [np.asarray(cols[4], dtype=bool)]
    plan = SegmentPlan(b, sq, sk, *arrays, multi=multi)
    plan.groups = _group(plan)
    return plan


def _relation(qs, ql, ks, kl, q_pos, k_pos):
    """False (full), True (causal, same span) or None (no key visible) for one same-document pair."""
    if q_pos is None:
        return False
    q_first, q_last = q_pos[qs], q_pos[qs + ql - 1]
    k_first, k_last = k_pos[ks], k_pos[ks + kl - 1]
    if k_last < q_first:
        return False
    if k_first > q_last:
        return None
    if q_first == k_first and q_last == k_last:
        return True
    raise ValueError(
        f"a query segment (positions {q_first}-{q_last}) and a key segment ({k_first}-{k_last}) of one document "
        f"overlap without being the same span; blocks must hold the same tokens or disjoint ones")


def _group(plan: SegmentPlan) -> list[PairGroup]:
    if plan.empty:
        return []
    # A query segment seen by several key segments appears once per group ("round"), so that a
    # group's results can be merged into the rows without two pairs of one group touching a row.
    by_q = np.argsort(plan.q_start, kind="stable")
    sorted_q = plan.q_start[by_q]
    first = np.concatenate([[True], sorted_q[1:] != sorted_q[:-1]])
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(sorted_q)), 0))
    occurrence = np.empty(len(sorted_q), dtype=np.int64)
    occurrence[by_q] = np.arange(len(sorted_q)) - run_start
    keys = np.stack([plan.q_len, plan.k_len, plan.causal.astype(np.int64), occurrence], axis=1)
    shapes, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(shapes) + 1))
    groups = []
    for g, (ql, kl, c, _) in enumerate(shapes.tolist()):
        idx = order[bounds[g]:bounds[g + 1]]
        groups.append(PairGroup(int(ql), int(kl), bool(c), plan.q_start[idx], plan.k_start[idx]))
    return groups


def _check_contiguous(doc_of_segment: np.ndarray, row: int) -> None:
    if len(np.unique(doc_of_segment)) != len(doc_of_segment):
        values, counts = np.unique(doc_of_segment, return_counts=True)
        raise ValueError(f"document id {int(values[counts > 1][0])} reappears after another document in batch row "
                         f"{row}; documents must be contiguous runs of tokens (number each packed document anew)")


def cached_plan(q_doc: torch.Tensor, k_doc: torch.Tensor, causal: bool) -> SegmentPlan:
    """plan_pairs(q_doc, k_doc, causal), built once per pair of document-id tensors.

    On CUDA the first call per batch copies the ids to the host (one sync per step, not per layer),
    unless they carry their host copy (keep_host_copy, as training's batches do)."""
    # The plan is kept on the query-id tensor itself, so the layers of one step (and their backward)
    # build it once and it goes away with the batch.
    key = (tensor_version(q_doc), tensor_version(k_doc), causal, tuple(q_doc.shape), tuple(k_doc.shape))
    if None in key[:2]:  # inference tensors: no version to tell a rewritten batch by, so no cache
        return plan_pairs(q_doc, k_doc, causal=causal)
    kept = getattr(q_doc, "_longctx_plan", None)
    if not isinstance(kept, _KeptPlan) or not kept.serves(key, k_doc):
        kept = _KeptPlan(key, k_doc, plan_pairs(q_doc, k_doc, causal=causal))
        q_doc._longctx_plan = kept
    return kept.plan


class _KeptPlan:
    """A plan kept on query ids (cached_plan), for the key-id tensor it was planned with. That tensor is
    told by a weak reference, not by id(): CPython gives a freed tensor's id to the next one, whose ids
    would then be attended with this plan. Pickled (with its tensor) without it: a copy plans anew."""

    __slots__ = ("key", "k_doc", "plan")

    def __init__(self, key: tuple, k_doc: torch.Tensor, plan: SegmentPlan):
        self.key, self.k_doc, self.plan = key, weakref.ref(k_doc), plan

    def serves(self, key: tuple, k_doc: torch.Tensor) -> bool:
        return self.key == key and self.k_doc is not None and self.k_doc() is k_doc

    def __getstate__(self):
        return self.key, None, self.plan

    def __setstate__(self, state):
        self.key, self.k_doc, self.plan = state


def whole_rows_plan(batch: int, seq_q: int, seq_k: int, causal: bool) -> SegmentPlan:
    """One pair per batch row covering all of it: plain (causal) attention expressed as a plan, so
    the CUDA varlen flash kernel serves it too."""
    rows = np.arange(batch, dtype=np.int64)
    plan = SegmentPlan(batch, seq_q, seq_k, rows * seq_q, np.full(batch, seq_q, dtype=np.int64), rows * seq_k,
                       np.full(batch, seq_k, dtype=np.int64), np.full(batch, causal, dtype=bool), multi=False)
    plan.groups = _group(plan)
    return plan
