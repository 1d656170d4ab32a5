"""Packing documents into fixed-size context windows: concat, bfd and datasculpt.

Input: per document its token count (EOS included: a document's tokens are its text's tokens
followed by one EOS), optionally its natural split points and a unit-norm embedding and a cluster.
Output: a `Packing`, i.e. segments `(window, doc, start, length)` in window order, where a segment
is the part `[start, start + length)` of document `doc`. Packing never drops, duplicates or reorders
a document's tokens: concatenating a document's segments in (window, offset) order gives back the
document (this is what the property tests check).

- `concat`: the classic baseline. Documents in input order, concatenated and cut every `context`
  tokens, so most documents that cross a cut are split, wherever the cut falls.
- `bfd`: best-fit decreasing by length. Documents longer than the window are first cut into
  window-sized pieces at natural boundaries (`split_points`); no other document is split.
- `datasculpt` (after DataSculpt, Lu et al. 2024): within each semantic cluster, the longest
  documents first, each into the window that maximises relevance (cosine between the document and
  the window's running centroid) times remaining capacity, never overflowing a window. Each cluster
  gets floor(tokens / context) windows, as many as it fills completely, so windows end up nearly
  full; what fits nowhere goes on to groups of related clusters, then to a small overflow set that
  is re-packed at the end (best fit), which is what keeps the fill rate at the level of bfd.

`packing_stats` reports the four figures every strategy is compared on: fill rate, the fraction
of documents split over more than one window (integrity), mean within-window cosine similarity
of distinct documents (homogeneity) and documents per window.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ..errors import DataError

STRATEGIES = ("datasculpt", "bfd", "concat")

# segment columns
WINDOW, DOC, START, LENGTH = range(4)


@dataclass
class Packing:
    context: int
    num_windows: int
    segments: np.ndarray  # int64 [n, 4]: window, doc, start, length; sorted by window, then offset

    def window_fill(self) -> np.ndarray:
        return np.bincount(self.segments[:, WINDOW], weights=self.segments[:, LENGTH],
                           minlength=self.num_windows).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# Splitting documents longer than the window


def split_points(length: int, context: int, breaks: np.ndarray | None = None,
                 strong: np.ndarray | None = None) -> list[int]:
    """Piece boundaries `[0, b1, ..., length]` cutting a document into pieces of at most `context`.

    `breaks` are sorted token offsets where a new line starts, `strong` those after a blank line
    (a paragraph, or a new top-level definition in code). A piece ends at the last strong break in
    the window's last 1/64, else at the last line break in its second half, else at exactly
    `context` tokens. So pieces stay nearly a full window (they are what fills most windows of a
    long-document corpus), and only the document's last piece may be shorter than half a window.
    """
    cuts = [0]
    s = 0
    while length - s > context:
        hi = s + context
        cut = hi
        for cand, lo in ((strong, hi - max(1, context // 64)), (breaks, s + context // 2)):
            if cand is not None and len(cand):
                j = bisect.bisect_right(cand, hi) - 1  # last candidate <= hi
                if j >= 0 and cand[j] > lo:
                    cut = int(cand[j])
                    break
        cuts.append(cut)
        s = cut
    cuts.append(length)
    return cuts


def _pieces(lengths: np.ndarray, context: int, breaks, strong) -> list[tuple[int, int, int]]:
    """(doc, start, length) pieces: whole documents, long ones cut at natural boundaries."""
    out = []
    for d, n in enumerate(lengths.tolist()):
        if n <= context:
            out.append((d, 0, n))
            continue
        cuts = split_points(n, context, None if breaks is None else breaks[d], None if strong is None else strong[d])
        out.extend((d, a, b - a) for a, b in zip(cuts[:-1], cuts[1:]))
    return out


# ----------------------------------------------------------------------------------------------
# Strategies


def pack_concat(lengths: np.ndarray, context: int) -> Packing:
    """Concatenate in input order and cut every `context` tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    segs = []
    w, used = 0, 0
    for d, n in enumerate(lengths.tolist()):
        start = 0
        while start < n:
            take = min(n - start, context - used)
            segs.append((w, d, start, take))
            start += take
            used += take
            if used == context:
                w, used = w + 1, 0
    num_windows = w + (used > 0)
    return Packing(context, num_windows, _as_segments(segs))


class _BestFit:
    """Open windows by remaining capacity: the fullest window a piece fits in, in O(log n)."""

    def __init__(self, context: int):
        self.context = context
        self.levels: list[int] = []          # sorted distinct remaining capacities
        self.by_level: dict[int, list[int]] = {}
        self.remaining: list[int] = []

    def _add(self, w: int, rem: int) -> None:
        if rem <= 0:
            return
        stack = self.by_level.get(rem)
        if stack is None:
            bisect.insort(self.levels, rem)
            stack = self.by_level[rem] = []
        stack.append(w)

    def place(self, n: int) -> int:
        j = bisect.bisect_left(self.levels, n)
        if j == len(self.levels):
            w = len(self.remaining)
            self.remaining.append(self.context)
        else:
            rem = self.levels[j]
            stack = self.by_level[rem]
            w = stack.pop()
            if not stack:
                del self.by_level[rem]
                self.levels.pop(j)
        self.remaining[w] -= n
        self._add(w, self.remaining[w])
        return w


def pack_bfd(lengths: np.ndarray, context: int, breaks=None, strong=None) -> Packing:
    """Best-fit decreasing; only documents longer than the window are split."""
    pieces = _pieces(np.asarray(lengths, dtype=np.int64), context, breaks, strong)
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][2], i))
    fit = _BestFit(context)
    segs = []
    for i in order:
        d, s, n = pieces[i]
        segs.append((fit.place(n), d, s, n))
    return _finish(segs, context)


def _greedy(pieces, k: int, context: int, emb: np.ndarray):
    """DataSculpt's placement: each piece (longest first) into the window maximising relevance x
    remaining capacity among the windows it fits in. Relevance is the cosine between the piece's
    document and the window's running centroid (floored at 0.01); an empty window has no centroid
    and counts as fully relevant, so the longest pieces seed the windows and the rest gather around
    them. Returns (placements [(window, doc, start, length)], pieces that fit nowhere)."""
    remaining = np.full(k, context, dtype=np.int64)
    centroid = np.zeros((k, emb.shape[1]), dtype=np.float32)
    norm = np.linalg.norm(centroid, axis=1)
    placed, overflow = [], []
    for d, s, n in pieces:
        fits = remaining >= n
        if not fits.any():
            overflow.append((d, s, n))
            continue
        e = emb[d]
        cos = np.where(norm > 0, (centroid @ e) / np.maximum(norm, 1e-12), 1.0)
        score = np.where(fits, np.maximum(cos, 0.01) * remaining, -1.0)
        w = int(np.argmax(score))
        remaining[w] -= n
        centroid[w] += e
        norm[w] = float(np.linalg.norm(centroid[w]))
        placed.append((w, d, s, n))
    return placed, overflow


def _longest_first(pieces):
    return sorted(pieces, key=lambda p: (-p[2], p[0], p[1]))


def pack_datasculpt(lengths: np.ndarray, context: int, embeddings: np.ndarray, clusters: np.ndarray,
                    breaks=None, strong=None) -> Packing:
    """Relevance x capacity greedy within clusters, longest first, then the merge step."""
    lengths = np.asarray(lengths, dtype=np.int64)
    emb = np.asarray(embeddings, dtype=np.float32)
    clusters = np.asarray(clusters)
    if len(emb) != len(lengths) or len(clusters) != len(lengths):
        raise DataError(f"datasculpt packing needs one embedding and one cluster per document; got "
                        f"{len(lengths)} documents, {len(emb)} embeddings, {len(clusters)} clusters.")
    pieces = _pieces(lengths, context, breaks, strong)
    by_cluster: dict[int, list[tuple[int, int, int]]] = {}
    for p in pieces:
        by_cluster.setdefault(int(clusters[p[0]]), []).append(p)

    segs: list[tuple[int, int, int, int]] = []
    next_window = 0
    rest: dict[int, list[tuple[int, int, int]]] = {}
    for c in sorted(by_cluster):
        for d, s, n in by_cluster[c]:
            if n == context:  # a whole window already: nothing to choose
                segs.append((next_window, d, s, n))
                next_window += 1
            else:
                rest.setdefault(c, []).append((d, s, n))
    # round 1 packs each cluster; round 2 packs what the clusters left over in groups of related
    # clusters (the near clusters merged until a group can fill `MIN_GROUP_WINDOWS` windows)
    overflow, next_window = _pack_groups(rest, segs, next_window, context, emb)
    groups = _group_clusters(overflow, clusters, emb, context)
    overflow, next_window = _pack_groups(groups, segs, next_window, context, emb)
    return _finish(_merge(segs, overflow, context, emb), context)


def _pack_groups(groups, segs, next_window: int, context: int, emb) -> tuple[list, int]:
    """Each group (longest first) into as many windows as it fills completely (rounding up would
    leave most groups a partly filled window), appended to `segs` from `next_window` on. Returns
    the pieces that did not fit, and the next free window."""
    overflow = []
    for c in sorted(groups):
        group = _longest_first(groups[c])
        k = sum(p[2] for p in group) // context
        if k == 0:
            overflow.extend(group)
            continue
        placed, spill = _greedy(group, k, context, emb)
        segs.extend((next_window + w, d, s, n) for w, d, s, n in placed)
        next_window += k
        overflow.extend(spill)
    return overflow, next_window


MIN_GROUP_WINDOWS = 4


def _group_clusters(pieces, clusters: np.ndarray, emb: np.ndarray, context: int) -> dict[int, list]:
    """Pieces grouped by cluster, then the smallest group repeatedly merged into the group with the
    most similar centroid, until every group holds MIN_GROUP_WINDOWS windows of tokens (or one is left)."""
    groups: dict[int, list] = {}
    for p in pieces:
        groups.setdefault(int(clusters[p[0]]), []).append(p)
    tokens = {c: sum(p[2] for p in g) for c, g in groups.items()}
    sums = {c: emb[[p[0] for p in g]].sum(0) for c, g in groups.items()}
    while len(groups) > 1:
        small = min(groups, key=lambda c: (tokens[c], c))
        if tokens[small] >= MIN_GROUP_WINDOWS * context:
            break
        others = [c for c in groups if c != small]
        cent = np.stack([sums[c] for c in others])
        cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
        target = others[int(np.argmax(cent @ sums[small]))]
        groups[target].extend(groups.pop(small))
        tokens[target] += tokens.pop(small)
        sums[target] = sums[target] + sums.pop(small)
    return groups


def _merge(segs, overflow, context: int, emb: np.ndarray, dissolve_below: float = 0.9, tight: float = 0.5,
           related: float = 0.3):
    """The merge step across clusters, for the pieces no cluster window took (and those of windows
    less than `dissolve_below` full, which are dissolved):

    1. gaps first: each piece, longest first, goes to the most related window (cosine to its
       centroid, at least `related`) among those whose gap it fits and fills at least `tight` of;
    2. the rest are packed among themselves like one more cluster (the same relevance x capacity
       greedy over ceil(tokens / context) windows); the little that still fits nowhere goes
       best-fit into any window's gap, or into new windows."""
    fill: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for w, d, _, n in segs:
        fill[w] = fill.get(w, 0) + n
        members.setdefault(w, []).append(d)
    weak = {w for w, f in fill.items() if f < dissolve_below * context}
    pool = _longest_first(list(overflow) + [(d, s, n) for w, d, s, n in segs if w in weak])
    kept = [seg for seg in segs if seg[0] not in weak]
    if not pool:
        return kept
    ids = [w for w in sorted(fill) if w not in weak]
    next_window = max(fill) + 1 if fill else 0
    rest = []
    if ids:
        remaining = np.array([context - fill[w] for w in ids], dtype=np.int64)
        centroid = np.stack([emb[members[w]].sum(0) for w in ids]).astype(np.float32)
        norm = np.linalg.norm(centroid, axis=1)
        for d, s, n in pool:
            ok = (remaining >= n) & (n >= tight * remaining)
            if not ok.any():
                rest.append((d, s, n))
                continue
            cos = np.where(ok, (centroid @ emb[d]) / np.maximum(norm, 1e-12), -2.0)
            w = int(np.argmax(cos))
            if cos[w] < related:
                rest.append((d, s, n))
                continue
            remaining[w] -= n
            centroid[w] += emb[d]
            norm[w] = float(np.linalg.norm(centroid[w]))
            kept.append((ids[w], d, s, n))
    else:
        rest = pool
    if rest:
        k = -(-sum(p[2] for p in rest) // context)
        placed, spill = _greedy(rest, k, context, emb)
        kept.extend((next_window + w, d, s, n) for w, d, s, n in placed)
        if spill:
            kept.extend(_best_fit_into(kept, spill, context))
    return kept


def _best_fit_into(segs, pieces, context: int):
    """Pieces best-fit (longest first) into the gaps of the windows of `segs`, or new windows."""
    fill: dict[int, int] = {}
    for w, _, _, n in segs:
        fill[w] = fill.get(w, 0) + n
    ids = sorted(fill)
    fit = _BestFit(context)
    for w in ids:
        fit.remaining.append(context - fill[w])
        fit._add(len(fit.remaining) - 1, context - fill[w])
    base = (ids[-1] + 1) if ids else 0
    out = []
    for d, s, n in _longest_first(pieces):
        slot = fit.place(n)
        out.append((ids[slot] if slot < len(ids) else base + slot - len(ids), d, s, n))
    return out


def pack(strategy: str, lengths, context: int, embeddings=None, clusters=None, breaks=None, strong=None) -> Packing:
    if context < 1:
        raise DataError(f"the context length must be positive, got {context}.")
    if strategy == "concat":
        return pack_concat(lengths, context)
    if strategy == "bfd":
        return pack_bfd(lengths, context, breaks, strong)
    if strategy == "datasculpt":
        if embeddings is None or clusters is None:
            raise DataError("the datasculpt strategy needs document embeddings and clusters.")
        return pack_datasculpt(lengths, context, embeddings, clusters, breaks, strong)
    raise DataError(f"unknown packing strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}.")


def _as_segments(segs) -> np.ndarray:
    return np.asarray(segs, dtype=np.int64).reshape(-1, 4)


def _finish(segs, context: int) -> Packing:
    """Number windows densely and order segments by window, then document, then start."""
    arr = _as_segments(segs)
    if len(arr) == 0:
        return Packing(context, 0, arr)
    arr = arr[np.lexsort((arr[:, START], arr[:, DOC], arr[:, WINDOW]))]
    _, dense = np.unique(arr[:, WINDOW], return_inverse=True)
    arr[:, WINDOW] = dense
    return Packing(context, int(dense.max()) + 1, arr)


# ----------------------------------------------------------------------------------------------
# Quality figures


def packing_stats(p: Packing, num_docs: int, embeddings: np.ndarray | None = None) -> dict:
    """Fill rate, split fraction, homogeneity (mean within-window cosine) and docs per window."""
    segs = p.segments
    tokens = int(segs[:, LENGTH].sum()) if len(segs) else 0
    fill = tokens / (p.num_windows * p.context) if p.num_windows else 0.0
    # a document is split when its tokens lie in more than one window
    pairs = np.unique(segs[:, [DOC, WINDOW]], axis=0) if len(segs) else np.zeros((0, 2), np.int64)
    windows_per_doc = np.bincount(pairs[:, 0], minlength=num_docs) if len(pairs) else np.zeros(num_docs)
    split = float((windows_per_doc > 1).sum() / num_docs) if num_docs else 0.0
    docs_per_window = np.bincount(pairs[:, 1], minlength=p.num_windows) if len(pairs) else np.zeros(0)
    stats = {
        "windows": int(p.num_windows),
        "tokens": tokens,
        "fill_rate": float(fill),
        "split_fraction": split,
        "docs_per_window": float(docs_per_window.mean()) if p.num_windows else 0.0,
    }
    if embeddings is not None and len(pairs):
        stats.update(homogeneity(pairs, np.asarray(embeddings, dtype=np.float64), p.num_windows))
    return stats


def homogeneity(doc_window: np.ndarray, emb: np.ndarray, num_windows: int) -> dict:
    """Mean over windows holding >= 2 distinct documents of their mean pairwise cosine.

    With unit vectors, the sum over pairs i < j of e_i . e_j is (|sum e|^2 - m) / 2, so each window
    costs one vector sum."""
    docs, windows = doc_window[:, 0], doc_window[:, 1]
    m = np.bincount(windows, minlength=num_windows)
    sums = np.zeros((num_windows, emb.shape[1]))
    np.add.at(sums, windows, emb[docs])
    sq = np.bincount(windows, weights=(emb[docs] ** 2).sum(1), minlength=num_windows)
    multi = m >= 2
    if not multi.any():
        return {"homogeneity": None, "multi_doc_windows": 0}
    pair_sum = ((sums[multi] ** 2).sum(1) - sq[multi]) / 2
    mean_cos = pair_sum / (m[multi] * (m[multi] - 1) / 2)
    return {"homogeneity": float(mean_cos.mean()), "multi_doc_windows": int(multi.sum())}
