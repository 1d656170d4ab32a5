"""Packing documents into samples (training sequences of exactly `seq_len` tokens): concat, bfd and
datasculpt.

Input: per document its token count (EOS included: a document's tokens are its text's tokens
followed by one EOS), optionally its natural cut points and a unit-norm embedding and a cluster.
Output: a `Packing`, i.e. segments `(sample, doc, start, length)` in sample order, where a segment
is the part `[start, start + length)` of document `doc`. Packing never drops, duplicates or reorders
a document's tokens: concatenating a document's segments in (sample, offset) order gives back the
document (this is what the property tests check).

- `concat`: the classic baseline. Documents in input order, concatenated and cut every `seq_len`
  tokens, so most documents that cross a cut are split, wherever the cut falls.
- `bfd`: best-fit decreasing by length. Documents longer than `seq_len` are first cut into
  sample-sized pieces at natural boundaries (`cut_points`); no other document is split.
- `datasculpt` (after DataSculpt, Lu et al. 2024): within each semantic cluster, the longest
  documents first, each into the sample that maximises relevance (cosine between the document and
  the sample's running centroid) times remaining capacity, never overflowing a sample. Each cluster
  gets floor(tokens / seq_len) samples, as many as it fills completely, so samples end up nearly
  full; what fits nowhere goes on to groups of related clusters, then to a small overflow set that
  is re-packed at the end (best fit), which is what keeps the fill rate at the level of bfd.

`packing_stats` reports the four figures every strategy is compared on: fill rate, the fraction
of documents split over more than one sample (integrity), mean within-sample cosine similarity
of distinct documents (homogeneity) and documents per sample.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ...errors import DataError
from .pack_search import fast_ok, fill_gaps, full_scan, greedy_many, group_clusters

STRATEGIES = ("datasculpt", "bfd", "concat")

# segment columns
SAMPLE, DOC, START, LENGTH = range(4)


@dataclass
class Packing:
    seq_len: int
    num_samples: int
    segments: np.ndarray  # int64 [n, 4]: sample, doc, start, length; sorted by sample, then offset

    def sample_fill(self) -> np.ndarray:
        return np.bincount(self.segments[:, SAMPLE], weights=self.segments[:, LENGTH],
                           minlength=self.num_samples).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# Splitting documents longer than seq_len


def cut_points(length: int, seq_len: int, breaks: np.ndarray | None = None,
               strong: np.ndarray | None = None) -> list[int]:
    """Piece boundaries `[0, b1, ..., length]` cutting a document into pieces of at most `seq_len`.

    `breaks` are sorted token offsets where a new line starts, `strong` those after a blank line
    (a paragraph, or a new top-level definition in code). A piece ends at the last strong break in
    the sample's last 1/64, else at the last line break in its second half, else at exactly
    `seq_len` tokens. So pieces stay nearly a full sample (they are what fills most samples of a
    long-document corpus), and only the document's last piece may be shorter than half a sample.
    """
    cuts = [0]
    s = 0
    while length - s > seq_len:
        hi = s + seq_len
        cut = hi
        for cand, lo in ((strong, hi - max(1, seq_len // 64)), (breaks, s + seq_len // 2)):
            if cand is not None and len(cand):
                j = bisect.bisect_right(cand, hi) - 1  # last candidate <= hi
                if j >= 0 and cand[j] > lo:
                    cut = int(cand[j])
                    break
        cuts.append(cut)
        s = cut
    cuts.append(length)
    return cuts


def _pieces(lengths: np.ndarray, seq_len: int, breaks, strong) -> list[tuple[int, int, int]]:
    """(doc, start, length) pieces: whole documents, long ones cut at natural boundaries."""
    out = []
    for d, n in enumerate(lengths.tolist()):
        if n <= seq_len:
            out.append((d, 0, n))
            continue
        cuts = cut_points(n, seq_len, None if breaks is None else breaks[d], None if strong is None else strong[d])
        out.extend((d, a, b - a) for a, b in zip(cuts[:-1], cuts[1:]))
    return out


# ----------------------------------------------------------------------------------------------
# Strategies


def pack_concat(lengths: np.ndarray, seq_len: int) -> Packing:
    """Concatenate in input order and cut every `seq_len` tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    segs = []
    w, used = 0, 0
    for d, n in enumerate(lengths.tolist()):
        start = 0
        while start < n:
            take = min(n - start, seq_len - used)
            segs.append((w, d, start, take))
            start += take
            used += take
            if used == seq_len:
                w, used = w + 1, 0
    num_samples = w + (used > 0)
    return Packing(seq_len, num_samples, _as_segments(segs))


class _BestFit:
    """Open samples by remaining capacity: the fullest sample a piece fits in, in O(log n)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
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
            self.remaining.append(self.seq_len)
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


def pack_bfd(lengths: np.ndarray, seq_len: int, breaks=None, strong=None) -> Packing:
    """Best-fit decreasing; only documents longer than seq_len are split."""
    pieces = _pieces(np.asarray(lengths, dtype=np.int64), seq_len, breaks, strong)
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][2], i))
    fit = _BestFit(seq_len)
    segs = []
    for i in order:
        d, s, n = pieces[i]
        segs.append((fit.place(n), d, s, n))
    return _finish(segs, seq_len)


def _greedy(pieces, k: int, seq_len: int, emb: np.ndarray):
    """DataSculpt's placement: each piece (longest first) into the sample maximising relevance x
    remaining capacity among the samples it fits in. Relevance is the cosine between the piece's
    document and the sample's running centroid (floored at 0.01); an empty sample has no centroid
    and counts as fully relevant, so the longest pieces seed the samples and the rest gather around
    them. Returns (placements [(sample, doc, start, length)], pieces that fit nowhere)."""
    remaining = np.full(k, seq_len, dtype=np.int64)
    centroid = np.zeros((k, emb.shape[1]), dtype=np.float32)
    norm = np.linalg.norm(centroid, axis=1)
    placed, overflow = [], []
    for d, s, n in pieces:
        e = emb[d]
        w = full_scan(remaining, centroid, norm, e, n)  # (the same rule greedy_many falls back to)
        if w < 0:
            overflow.append((d, s, n))
            continue
        remaining[w] -= n
        centroid[w] += e
        norm[w] = float(np.linalg.norm(centroid[w]))
        placed.append((w, d, s, n))
    return placed, overflow


def _longest_first(pieces):
    return sorted(pieces, key=lambda p: (-p[2], p[0], p[1]))


def pack_datasculpt(lengths: np.ndarray, seq_len: int, embeddings: np.ndarray, clusters: np.ndarray,
                    breaks=None, strong=None) -> Packing:
    """Relevance x capacity greedy within clusters, longest first, then the merge step."""
    lengths = np.asarray(lengths, dtype=np.int64)
    emb = np.asarray(embeddings, dtype=np.float32)
    clusters = np.asarray(clusters)
    if len(emb) != len(lengths) or len(clusters) != len(lengths):
        raise DataError(f"datasculpt packing needs one embedding and one cluster per document; got "
                        f"{len(lengths)} documents, {len(emb)} embeddings, {len(clusters)} clusters.")
    pieces = _pieces(lengths, seq_len, breaks, strong)
    by_cluster: dict[int, list[tuple[int, int, int]]] = {}
    for p in pieces:
        by_cluster.setdefault(int(clusters[p[0]]), []).append(p)

    segs: list[tuple[int, int, int, int]] = []
    next_sample = 0
    rest: dict[int, list[tuple[int, int, int]]] = {}
    for c in sorted(by_cluster):
        for d, s, n in by_cluster[c]:
            if n == seq_len:  # a whole sample already: nothing to choose
                segs.append((next_sample, d, s, n))
                next_sample += 1
            else:
                rest.setdefault(c, []).append((d, s, n))
    # round 1 packs each cluster; round 2 packs what the clusters left over in groups of related
    # clusters (the near clusters merged until a group can fill pack_search.MIN_GROUP_SAMPLES samples);
    # pack_search.py makes the same choices as a pass over all samples or groups, without one
    fast = fast_ok(emb)
    overflow, next_sample = _pack_groups(rest, segs, next_sample, seq_len, emb, fast)
    groups = group_clusters(overflow, clusters, emb, seq_len, fast)
    overflow, next_sample = _pack_groups(groups, segs, next_sample, seq_len, emb, fast)
    return _finish(_merge(segs, overflow, seq_len, emb, fast), seq_len)


def _pack_groups(groups, segs, next_sample: int, seq_len: int, emb, fast: bool) -> tuple[list, int]:
    """Each group (longest first) into as many samples as it fills completely (rounding up would
    leave most groups a partly filled sample), appended to `segs` from `next_sample` on. Returns
    the pieces that did not fit, and the next free sample. (The groups' greedies run side by side:
    pack_search.greedy_many.)"""
    todo = [(c, _longest_first(groups[c])) for c in sorted(groups)]
    ks = [sum(p[2] for p in group) // seq_len for _, group in todo]
    done = iter(greedy_many([(group, k) for (_, group), k in zip(todo, ks) if k], seq_len, emb, _greedy, fast))
    overflow = []
    for (_, group), k in zip(todo, ks):
        if k == 0:
            overflow.extend(group)
            continue
        placed, spill = next(done)
        segs.extend((next_sample + w, d, s, n) for w, d, s, n in placed)
        next_sample += k
        overflow.extend(spill)
    return overflow, next_sample


def _merge(segs, overflow, seq_len: int, emb: np.ndarray, fast: bool = True, dissolve_below: float = 0.9,
           tight: float = 0.5, related: float = 0.3):
    """The merge step across clusters, for the pieces no cluster sample took (and those of samples
    less than `dissolve_below` full, which are dissolved):

    1. gaps first: each piece, longest first, goes to the most related sample (cosine to its
       centroid, at least `related`) among those whose gap it fits and fills at least `tight` of;
    2. the rest are packed among themselves like one more cluster (the same relevance x capacity
       greedy over ceil(tokens / seq_len) samples); the little that still fits nowhere goes
       best-fit into any sample's gap, or into new samples."""
    fill: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for w, d, _, n in segs:
        fill[w] = fill.get(w, 0) + n
        members.setdefault(w, []).append(d)
    weak = {w for w, f in fill.items() if f < dissolve_below * seq_len}
    pool = _longest_first(list(overflow) + [(d, s, n) for w, d, s, n in segs if w in weak])
    kept = [seg for seg in segs if seg[0] not in weak]
    if not pool:
        return kept
    ids = [w for w in sorted(fill) if w not in weak]
    next_sample = max(fill) + 1 if fill else 0
    rest = pool
    if ids:
        remaining = np.array([seq_len - fill[w] for w in ids], dtype=np.int64)
        centroid = np.stack([emb[members[w]].sum(0) for w in ids]).astype(np.float32)
        placed, rest = fill_gaps(pool, remaining, centroid, emb, tight, related, fast)
        kept.extend((ids[w], d, s, n) for w, d, s, n in placed)
    if rest:
        k = -(-sum(p[2] for p in rest) // seq_len)
        placed, spill = _greedy(rest, k, seq_len, emb)
        kept.extend((next_sample + w, d, s, n) for w, d, s, n in placed)
        if spill:
            kept.extend(_best_fit_into(kept, spill, seq_len))
    return kept


def _best_fit_into(segs, pieces, seq_len: int):
    """Pieces best-fit (longest first) into the gaps of the samples of `segs`, or new samples."""
    fill: dict[int, int] = {}
    for w, _, _, n in segs:
        fill[w] = fill.get(w, 0) + n
    ids = sorted(fill)
    fit = _BestFit(seq_len)
    for w in ids:
        fit.remaining.append(seq_len - fill[w])
        fit._add(len(fit.remaining) - 1, seq_len - fill[w])
    base = (ids[-1] + 1) if ids else 0
    out = []
    for d, s, n in _longest_first(pieces):
        slot = fit.place(n)
        out.append((ids[slot] if slot < len(ids) else base + slot - len(ids), d, s, n))
    return out


def pack(strategy: str, lengths, seq_len: int, embeddings=None, clusters=None, breaks=None, strong=None) -> Packing:
    if seq_len < 1:
        raise DataError(f"seq_len (the sequence length) must be positive, got {seq_len}.")
    if strategy == "concat":
        return pack_concat(lengths, seq_len)
    if strategy == "bfd":
        return pack_bfd(lengths, seq_len, breaks, strong)
    if strategy == "datasculpt":
        if embeddings is None or clusters is None:
            raise DataError("the datasculpt strategy needs document embeddings and clusters.")
        return pack_datasculpt(lengths, seq_len, embeddings, clusters, breaks, strong)
    raise DataError(f"unknown packing strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}.")


def _as_segments(segs) -> np.ndarray:
    return np.asarray(segs, dtype=np.int64).reshape(-1, 4)


def _finish(segs, seq_len: int) -> Packing:
    """Number samples densely and order segments by sample, then document, then start."""
    arr = _as_segments(segs)
    if len(arr) == 0:
        return Packing(seq_len, 0, arr)
    arr = arr[np.lexsort((arr[:, START], arr[:, DOC], arr[:, SAMPLE]))]
    _, dense = np.unique(arr[:, SAMPLE], return_inverse=True)
    arr[:, SAMPLE] = dense
    return Packing(seq_len, int(dense.max()) + 1, arr)


# ----------------------------------------------------------------------------------------------
# Quality figures


def packing_stats(p: Packing, num_docs: int, embeddings: np.ndarray | None = None) -> dict:
    """Fill rate, split fraction, homogeneity (mean within-sample cosine) and docs per sample."""
    segs = p.segments
    tokens = int(segs[:, LENGTH].sum()) if len(segs) else 0
    fill = tokens / (p.num_samples * p.seq_len) if p.num_samples else 0.0
    # a document is split when its tokens lie in more than one sample
    pairs = np.unique(segs[:, [DOC, SAMPLE]], axis=0) if len(segs) else np.zeros((0, 2), np.int64)
    samples_per_doc = np.bincount(pairs[:, 0], minlength=num_docs) if len(pairs) else np.zeros(num_docs)
    docs_cut = float((samples_per_doc > 1).sum() / num_docs) if num_docs else 0.0
    docs_per_sample = np.bincount(pairs[:, 1], minlength=p.num_samples) if len(pairs) else np.zeros(0)
    stats = {
        "samples": int(p.num_samples),
        "tokens": tokens,
        "fill_rate": float(fill),
        "split_fraction": docs_cut,  # (the stored name: documents cut over more than one sample)
        "docs_per_sample": float(docs_per_sample.mean()) if p.num_samples else 0.0,
    }
    if embeddings is not None and len(pairs):
        stats.update(homogeneity(pairs, np.asarray(embeddings, dtype=np.float64), p.num_samples))
    return stats


def homogeneity(doc_sample: np.ndarray, emb: np.ndarray, num_samples: int) -> dict:
    """Mean over samples holding >= 2 distinct documents of their mean pairwise cosine.

    With unit vectors, the sum over pairs i < j of e_i . e_j is (|sum e|^2 - m) / 2, so each sample
    costs one vector sum."""
    docs, samples = doc_sample[:, 0], doc_sample[:, 1]
    m = np.bincount(samples, minlength=num_samples)
    sums = np.zeros((num_samples, emb.shape[1]))
    np.add.at(sums, samples, emb[docs])
    sq = np.bincount(samples, weights=(emb[docs] ** 2).sum(1), minlength=num_samples)
    multi = m >= 2
    if not multi.any():
        return {"homogeneity": None, "multi_doc_samples": 0}
    pair_sum = ((sums[multi] ** 2).sum(1) - sq[multi]) / 2
    mean_cos = pair_sum / (m[multi] * (m[multi] - 1) / 2)
    return {"homogeneity": float(mean_cos.mean()), "multi_doc_samples": int(multi.sum())}
