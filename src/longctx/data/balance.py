"""Balancing variable-cost samples over data-parallel ranks (after Zeppelin / verl's seqlen balancing).

Every sample has the same length, but not the same work: under a document mask attention costs
sum_d s_d^2 over its documents (causal, so half of it), the rest of the model costs per real token,
and padding costs nothing that matters. The estimate is `a * sum_d s_d^2 + b * real_tokens`.

A global batch of B samples is split into dp groups of exactly B / dp samples (each rank must
get the same number of rows) with the largest differencing method (Karmarkar-Karp), in its
k-way form with equal cardinality: samples sorted by cost are taken dp at a time, each forming a
partial solution of dp singleton groups; the two partial solutions with the largest spread are
repeatedly merged by pairing the heaviest groups of one with the lightest of the other; then
single swaps between the heaviest and the lightest group while they lower the maximum.

The result is a permutation of the batch: rank r takes rows [r * B/dp, (r + 1) * B/dp), exactly
as `local_batch` (parallel/context/shares.py) slices it. The loss is a global sum over the batch, so the permutation
does not change what is computed, only where.
"""

from __future__ import annotations

import heapq

import numpy as np


def karmarkar_karp(costs, k: int) -> list[list[int]]:
    """Indices of `costs` in k groups of equal size (len(costs) must be divisible by k)."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if k <= 1:
        return [list(range(n))]
    if n % k:
        raise ValueError(f"{n} items cannot be split into {k} groups of equal size")
    order = np.argsort(costs, kind="stable")
    heap = []
    for g in range(n // k):
        items = order[g * k:(g + 1) * k]
        groups = [(float(costs[i]), [int(i)]) for i in items]
        groups.sort(key=lambda x: -x[0])
        spread = groups[0][0] - groups[-1][0]
        heapq.heappush(heap, (-spread, g, groups))
    tie = n // k
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a is sorted heaviest first; pair its heaviest with b's lightest
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda x: -x[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return _refine([list(ids) for _, ids in heap[0][2]], costs)


def _refine(groups: list[list[int]], costs: np.ndarray, rounds: int = 64) -> list[list[int]]:
    """Local search after Karmarkar-Karp: swap one item between the heaviest and the lightest group
    while that lowers the heavier of the two (KK is greedy: a very heavy item ends up with items
    that are light within their round, not the lightest overall)."""
    sums = [float(costs[g].sum()) for g in groups]
    for _ in range(rounds):
        h = int(np.argmax(sums))
        lo = int(np.argmin(sums))
        if h == lo:
            break
        ch, cl = costs[groups[h]], costs[groups[lo]]
        delta = ch[:, None] - cl[None, :]  # moving h-item i out and lo-item j in lowers h by delta
        gap = sums[h] - sums[lo]
        new_max = np.maximum(sums[h] - delta, sums[lo] + delta)
        i, j = np.unravel_index(int(np.argmin(np.where(delta > 0, new_max, np.inf))), delta.shape)
        if not (delta[i, j] > 0 and new_max[i, j] < sums[h] - 1e-12 * max(gap, 1.0)):
            break
        groups[h][i], groups[lo][j] = groups[lo][j], groups[h][i]
        sums[h] -= delta[i, j]
        sums[lo] += delta[i, j]
    return [sorted(g) for g in groups]


def balanced_order(indices: list[int], costs: np.ndarray, dp: int) -> list[int]:
    """`indices` permuted so that consecutive blocks of len/dp go to ranks with balanced cost."""
    if dp <= 1 or len(indices) % dp:
        return list(indices)
    groups = karmarkar_karp([costs[i] for i in indices], dp)
    groups.sort(key=lambda g: g[0])  # deterministic rank order
    return [indices[j] for g in groups for j in g]


def imbalance(indices: list[int], costs: np.ndarray, dp: int) -> float:
    """max / mean of the per-rank cost sums when rank r takes the r-th block of the batch."""
    if dp <= 1:
        return 1.0
    per = np.add.reduceat(np.asarray([costs[i] for i in indices], dtype=np.float64),
                          np.arange(0, len(indices), len(indices) // dp))
    mean = per.mean()
    return float(per.max() / mean) if mean > 0 else 1.0
