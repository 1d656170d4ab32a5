"""The searches of datasculpt packing (pack.py), answered without a pass over every group or sample
per choice, and with exactly the choices such a pass makes (the same packing, bit for bit).

- `greedy_many`: the relevance x capacity greedy of many groups (pack._greedy) run side by side, a
  step placing every group's next piece with a few array operations over all groups' samples;
- `group_clusters`: the clusters' leftovers merged, smallest group first, into the group whose
  centroid is most similar, until every group fills MIN_GROUP_SAMPLES samples;
- `fill_gaps`: each leftover piece, longest first, into the most related nearly full sample whose gap
  it fits and fills at least `tight` of (or nowhere, below `related`).

A pass per merge (piece) over every group (sample) made packing grow with the square of the
documents. Here the smallest group comes from a heap ((tokens, cluster): min's tie rule) and a piece's
candidate samples (gap in [n, n / tight]) from an index of the samples sorted by gap.

Bit for bit: the pass scores with one float32 matrix-vector product, whose rounding depends on the
matrix's shape (BLAS blocks rows), so one row's score cannot be recomputed alone. Each candidate's
score is computed in float64 and bracketed by a bound on the float32 rounding (|fl(x.y) - x.y| <=
gamma_n sum |x_i y_i|, taken twice over). A choice the brackets decide (one candidate strictly above
every other and the threshold; or candidates whose scores are exact, such as empty samples, where the
first wins as in argmax) is the pass's; a closer call (a near tie, a score at the threshold) is made by
the pass itself, as before. Embeddings that are not finite or out of range (|x| > 1e6) always take it.
"""

from __future__ import annotations

import heapq

import numpy as np

MIN_GROUP_SAMPLES = 4
U32 = 2.0 ** -24  # float32 unit roundoff


def fast_ok(emb: np.ndarray) -> bool:
    """Whether the float32 rounding bounds hold for these embeddings (finite, |x| <= 1e6)."""
    return bool(emb.size == 0 or (np.isfinite(emb).all() and np.abs(emb).max() <= 1e6))


def _slack(dim: int) -> float:
    return (4 * dim + 16) * U32


# ----------------------------------------------------------------------------------------------
# Groups of related clusters


def group_clusters(pieces, clusters: np.ndarray, emb: np.ndarray, seq_len: int, fast: bool = True) -> dict[int, list]:
    """Pieces grouped by cluster, then the smallest group repeatedly merged into the group with the
    most similar centroid, until every group holds MIN_GROUP_SAMPLES samples of tokens (or one is left).
    The smallest is the least tokens, then the lowest cluster; the most similar, of equal ones, the
    group met first in `pieces`."""
    groups: dict[int, list] = {}
    for p in pieces:
        groups.setdefault(int(clusters[p[0]]), []).append(p)
    tokens = {c: sum(p[2] for p in g) for c, g in groups.items()}
    sums = {c: emb[[p[0] for p in g]].sum(0) for c, g in groups.items()}
    near = _Nearest(list(groups), sums, emb.shape[1], fast)
    heap = [(t, c) for c, t in tokens.items()]
    heapq.heapify(heap)
    while len(groups) > 1:
        while heap[0][1] not in groups or tokens[heap[0][1]] != heap[0][0]:
            heapq.heappop(heap)  # a merged group's entry, or one from before it grew
        small = heapq.heappop(heap)[1]
        if tokens[small] >= MIN_GROUP_SAMPLES * seq_len:
            break
        near.drop(small)
        target = near.find(small, groups)
        groups[target].extend(groups.pop(small))
        tokens[target] += tokens.pop(small)
        sums[target] = sums[target] + sums.pop(small)
        near.update(target)
        heapq.heappush(heap, (tokens[target], target))
    return groups


class _Nearest:
    """The group whose centroid has the largest cosine with a group's sum (first in `keys` order of
    equal ones), as `argmax(normalised centroids (float32) @ sum)` over the other groups."""

    def __init__(self, keys: list[int], sums: dict, dim: int, fast: bool):
        self.keys, self.sums, self.fast = keys, sums, fast
        self.row = {c: i for i, c in enumerate(keys)}
        self.alive = np.ones(len(keys), dtype=bool)
        self.unit = np.zeros((len(keys), dim))
        self.irregular = np.zeros(len(keys), dtype=bool)  # a norm float32 may under- or overflow
        self.slack = _slack(dim)
        if fast:
            for c in keys:
                self.update(c)

    def update(self, c: int) -> None:
        if not self.fast:
            return
        i = self.row[c]
        v = self.sums[c].astype(np.float64)
        n = float(np.sqrt(v @ v))
        self.unit[i] = v / n if n > 0 else 0.0
        self.irregular[i] = n != 0 and not 1e-10 <= n <= 1e15

    def drop(self, c: int) -> None:
        self.alive[self.row[c]] = False

    def find(self, small: int, groups: dict) -> int:
        if self.fast and not (self.irregular & self.alive).any():
            s = self.sums[small].astype(np.float64)
            score = self.unit @ s
            err = self.slack * float(np.sqrt(s @ s)) + 1e-30
            score[~self.alive] = -np.inf
            j = int(np.argmax(score))
            if np.count_nonzero(score + err >= score[j] - err) == 1:
                return self.keys[j]
        # a close call: the full scan
        others = [c for c in groups if c != small]
        cent = np.stack([self.sums[c] for c in others])
        cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
        return others[int(np.argmax(cent @ self.sums[small]))]


# ----------------------------------------------------------------------------------------------
# Gaps of nearly full samples


def fill_gaps(pool, remaining: np.ndarray, centroid: np.ndarray, emb: np.ndarray, tight: float, related: float,
              fast: bool = True) -> tuple[list, list]:
    """Each piece of `pool` (in order) to the sample of highest cosine with its centroid (`centroid`
    [samples, dim] float32, sums of the members' embeddings) among those whose gap (`remaining`) it
    fits and fills at least `tight` of, if that cosine is at least `related`. `remaining` and
    `centroid` are updated. Returns the placements [(sample row, doc, start, length)] and the pieces
    placed nowhere."""
    norm = np.linalg.norm(centroid, axis=1)
    placed, rest = [], []
    index = _GapIndex(remaining, tight) if fast and tight > 0 else None
    bounds = sorted((related, float(np.float32(related))))
    slack = _slack(centroid.shape[1])
    for d, s, n in pool:
        e = emb[d]
        w = None
        if index is not None:
            cand = index.candidates(n)
            w = -1 if len(cand) == 0 else _decide(cand, centroid, norm, e, bounds, slack)
        if w is None:  # a close call (or no index): the full scan
            ok = (remaining >= n) & (n >= tight * remaining)
            w = -1
            if ok.any():
                cos = np.where(ok, (centroid @ e) / np.maximum(norm, 1e-12), -2.0)
                w = int(np.argmax(cos))
                if cos[w] < related:
                    w = -1
        if w < 0:
            rest.append((d, s, n))
            continue
        remaining[w] -= n
        centroid[w] += e
        norm[w] = float(np.linalg.norm(centroid[w]))
        if index is not None:
            index.moved(w)
        placed.append((w, d, s, n))
    return placed, rest


def _decide(cand: np.ndarray, centroid: np.ndarray, norm: np.ndarray, e: np.ndarray, bounds, slack: float):
    """The full scan's choice among candidate rows `cand` when the float32 rounding bounds decide it:
    a row, or -1 for none (every cosine below the threshold); None when they do not."""
    norm_c = norm[cand].astype(np.float64)
    nm = np.maximum(norm_c, float(np.float32(1e-12)))  # as the full scan clamps (float32)
    cos = (centroid[cand] @ e).astype(np.float64) / nm  # float32 too: its rounding counts twice below
    # |row| <= its float32 norm (1 + 2 dim u), plus what squares below float32's range lost
    size = (norm_c * (1 + 2 * len(e) * U32) + 1e-17) * float(np.sqrt(np.dot(e.astype(np.float64), e)))
    err = (2 * slack * size + 1e-30) / nm + 2 * U32 * np.abs(cos)
    if (cos + err).max() < bounds[0]:
        return -1
    j = int(np.argmax(cos - err))
    lo = cos[j] - err[j]
    if lo > bounds[1] and np.count_nonzero(cos + err >= lo) == 1:
        return int(cand[j])
    return None


class _GapIndex:
    """Rows by remaining capacity (sorted, so a piece's candidates are a slice), with the rows whose
    gap changed since the last sort kept aside and checked one by one (re-sorted past sqrt(rows))."""

    def __init__(self, remaining: np.ndarray, tight: float):
        self.rem, self.tight = remaining, tight
        self.limit = max(64, int(len(remaining) ** 0.5))
        self._sort()

    def _sort(self) -> None:
        self.order = np.argsort(self.rem, kind="stable")
        self.sorted = self.rem[self.order]
        self.scaled = self.tight * self.sorted  # nondecreasing: tight > 0
        self.live = np.ones(len(self.rem), dtype=bool)
        self.at = np.empty(len(self.rem), dtype=np.int64)
        self.at[self.order] = np.arange(len(self.rem))
        self.aside: dict[int, None] = {}

    def moved(self, w: int) -> None:
        self.live[self.at[w]] = False
        self.aside[w] = None
        if len(self.aside) > self.limit:
            self._sort()

    def candidates(self, n: int) -> np.ndarray:
        """Rows with remaining >= n and n >= tight * remaining (the full scan's test, element by element)."""
        a = int(np.searchsorted(self.sorted, n, "left"))
        b = int(np.searchsorted(self.scaled, n, "right"))
        out = self.order[a:b][self.live[a:b]] if a < b else np.zeros(0, dtype=np.int64)
        if self.aside:
            m = np.fromiter(self.aside, dtype=np.int64, count=len(self.aside))
            r = self.rem[m]
            out = np.concatenate([out, m[(r >= n) & (n >= self.tight * r)]])
        return out


# ----------------------------------------------------------------------------------------------
# The relevance x capacity greedy of many groups at once


def greedy_many(jobs, seq_len: int, emb: np.ndarray, greedy, fast: bool = True) -> list:
    """`greedy(pieces, k, seq_len, emb)` (pack._greedy) for each (pieces, k) of `jobs`, all groups
    stepping together: step t places every group's t-th piece, its samples scored in one pass over all
    groups' samples (float64, bracketed as above), so a step costs a few array operations, not a few
    per group. A group whose bracket does not decide the step's choice takes it from its own full scan
    (its samples' float32 product, as `greedy` computes it). Returns [(placements, overflow)] in `jobs`' order."""
    if len(jobs) < 2 or not fast:
        return [greedy(pieces, k, seq_len, emb) for pieces, k in jobs]
    order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j][0]))  # active groups: a prefix
    ks = np.array([jobs[j][1] for j in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(ks)[:-1]])
    gid = np.repeat(np.arange(len(order)), ks)
    rows = int(ks.sum())
    dim = emb.shape[1]
    rem = np.full(rows, seq_len, dtype=np.int64)
    centroid = np.zeros((rows, dim), dtype=np.float32)
    c64 = np.zeros((rows, dim))
    norm = np.zeros(rows, dtype=np.float32)
    e_norm = np.sqrt(np.einsum("ij,ij->i", emb, emb, dtype=np.float64))
    out: list = [([], []) for _ in order]
    lengths = [len(jobs[j][0]) for j in order]
    g_end = len(order)
    for t in range(lengths[0]):
        while lengths[g_end - 1] <= t:  # groups with more than t pieces
            g_end -= 1
        end = int(starts[g_end - 1] + ks[g_end - 1])
        step = [jobs[j][0][t] for j in order[:g_end]]
        ds = np.array([p[0] for p in step], dtype=np.int64)
        ns = np.array([p[2] for p in step], dtype=np.int64)
        chosen = _step(rem[:end], norm[:end], c64[:end], emb, e_norm, ds, ns, gid[:end], starts[:g_end])
        for g in np.flatnonzero(chosen == -2).tolist():  # undecided: the group's own full scan
            a, b = int(starts[g]), int(starts[g] + ks[g])
            chosen[g] = full_scan(rem[a:b], centroid[a:b], norm[a:b], emb[ds[g]], int(ns[g]))
            chosen[g] += a if chosen[g] >= 0 else 0
        placed = np.flatnonzero(chosen >= 0)
        ws = chosen[placed]
        rem[ws] -= ns[placed]
        centroid[ws] += emb[ds[placed]]  # distinct rows: as one row at a time
        c64[ws] = centroid[ws]
        for w in ws.tolist():
            v = centroid[w]
            norm[w] = np.sqrt(v.dot(v))  # np.linalg.norm of a vector, as greedy computes it
        for g, w in enumerate(chosen.tolist()):
            if w < 0:
                out[g][1].append(step[g])
            else:
                out[g][0].append((w - int(starts[g]), *step[g]))
    result: list = [None] * len(jobs)
    for g, j in enumerate(order):
        result[j] = out[g]
    return result


def _step(rem, norm, c64, emb, e_norm, ds, ns, gid, starts) -> np.ndarray:
    """Each group's chosen row (-1: fits nowhere, -2: the brackets do not decide)."""
    n_row = ns[gid]
    fits = rem >= n_row
    anyfit = np.maximum.reduceat(rem, starts) >= ns
    e_rows = emb[ds].astype(np.float64)[gid]
    nm = np.maximum(norm, np.float32(1e-12)).astype(np.float64)
    cos = np.einsum("ij,ij->i", c64, e_rows) / nm
    size = (norm.astype(np.float64) * (1 + 2 * c64.shape[1] * U32) + 1e-17) * e_norm[ds][gid]
    err = (_slack(c64.shape[1]) * size + 1e-30) / nm + 2 * U32 * np.abs(cos)
    empty = norm == 0  # cosine exactly 1
    cos[empty], err[empty] = 1.0, 0.0
    floor = float(np.float32(0.01))
    lo = np.maximum(cos - err, floor) * rem
    hi = np.maximum(cos + err, floor) * rem
    exact = empty | (cos + err < floor) | ~fits
    lo[~fits] = hi[~fits] = -1.0
    best = np.maximum.reduceat(lo, starts)
    contender = hi >= best[gid]
    count = np.add.reduceat(contender, starts)
    decided = (count == 1) | (count == np.add.reduceat(contender & exact, starts))
    first = np.full(len(starts), -1, dtype=np.int64)
    at = np.flatnonzero(contender)
    groups, idx = np.unique(gid[at], return_index=True)
    first[groups] = at[idx]
    return np.where(~anyfit, -1, np.where(decided, first, -2))


def full_scan(remaining, centroid, norm, e, n: int) -> int:
    """The relevance x capacity choice of pack._greedy for one piece of length n over one group's samples
    (-1: fits nowhere): the largest max(cosine, 0.01) x remaining among samples it fits in, an empty
    sample's cosine 1."""
    fits = remaining >= n
    if not fits.any():
        return -1
    cos = np.where(norm > 0, (np.ascontiguousarray(centroid) @ e) / np.maximum(norm, 1e-12), 1.0)
    score = np.where(fits, np.maximum(cos, 0.01) * remaining, -1.0)
    return int(np.argmax(score))
