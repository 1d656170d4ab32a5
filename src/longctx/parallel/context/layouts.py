"""Which positions of a sequence each (ctx rank, head rank) holds, and the attention work that gives
each context rank: the one home of the zigzag and document-balanced layouts (pure numpy).

Context group of size c (ring), head group of size h (all-to-all). Zigzag: the sequence is cut into
2c equal chunks and context rank i holds chunks i and 2c-1-i: under a causal mask the early chunk
has little to attend to and the late one a lot, so every context rank gets the same work, and in
every ring step after the first exactly half of the block is needed (ring.py skips the other half).
Inside a head group, the context rank's part is cut again into h contiguous pieces, one per head
rank, so the all-to-all gathers it back in order. Packed documents change the work (a token sees
only its own document): `parallel.seq_balance = docs` balances that instead (doc_balance.py).

sequence.py moves tensors by these positions; doc_balance.py computes the docs balance from them.
"""

from __future__ import annotations

import numpy as np

from ...job.checks import check_divisible

SEQ_BALANCES = ("docs", "zigzag")  # parallel.seq_balance



def zigzag_positions(seq_len: int, ctx: int, head: int) -> np.ndarray:
    """int64 [ctx, head, seq_len // (ctx * head)]: the global positions each rank holds, in local order."""
    check_divisible(seq_len, ctx, head)
    chunk = seq_len // (2 * ctx)
    r = np.arange(ctx)[:, None]
    a = np.arange(chunk)[None, :]
    per_ctx = np.concatenate([r * chunk + a, (2 * ctx - 1 - r) * chunk + a], axis=1)  # [ctx, seq // ctx]
    return per_ctx.reshape(ctx, head, -1).astype(np.int64)


def check_doc_ids(doc_ids) -> np.ndarray:
    """Host int64 [batch, seq] document ids whose documents are contiguous runs, or a ValueError."""
    ids = doc_ids.detach().cpu().numpy() if hasattr(doc_ids, "detach") else np.asarray(doc_ids)
    if ids.ndim != 2:
        raise ValueError(f"document ids must be shaped [batch, seq], got {tuple(ids.shape)}")
    ids = ids.astype(np.int64, copy=False)
    for r, row in enumerate(ids):
        starts = np.concatenate([[0], np.flatnonzero(row[1:] != row[:-1]) + 1])
        runs = row[starts]
        if len(np.unique(runs)) != len(runs):
            values, counts = np.unique(runs, return_counts=True)
            raise ValueError(f"document id {int(values[counts > 1][0])} reappears after another document in batch "
                             f"row {r}; documents must be contiguous runs of tokens (number each packed document "
                             f"anew)")
    return ids


def doc_runs(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each document = maximal run of equal ids."""
    seq = doc_ids.size
    if seq == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1]).astype(np.int64)
    lengths = np.diff(np.append(starts, seq)).astype(np.int64)
    return starts, lengths


def token_work(doc_ids: np.ndarray) -> np.ndarray:
    """Visible keys of each query token under a causal document mask: offset within its document + 1."""
    starts, lengths = doc_runs(doc_ids)
    return np.arange(doc_ids.size, dtype=np.int64) - np.repeat(starts, lengths) + 1


def rank_work(doc_ids: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Visible (query, key) pairs per ctx rank [ctx] of an assignment [ctx, head, seq_local]."""
    doc_ids = np.asarray(doc_ids).ravel()
    indices = np.asarray(indices)
    return token_work(doc_ids)[indices.reshape(indices.shape[0], -1)].sum(axis=1)


def rank_runs(doc_ids: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Contiguous same-document runs per ctx rank [ctx] (each a separate query / key block for the
    kernels) of an assignment [ctx, head, seq_local], its ctx rank's positions taken in order."""
    doc_ids = np.asarray(doc_ids).ravel()
    idx = np.asarray(indices)
    idx = idx.reshape(idx.shape[0], -1)
    if idx.shape[1] == 0:
        return np.zeros(idx.shape[0], np.int64)
    new = (idx[:, 1:] != idx[:, :-1] + 1) | (doc_ids[idx[:, 1:]] != doc_ids[idx[:, :-1]])
    return 1 + new.sum(axis=1)
