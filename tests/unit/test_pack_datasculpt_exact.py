"""datasculpt packing is exactly what it was before pack_search.py (the merge step's searches without a
pass over every group and sample): the same samples, segments and order, compared against a frozen
copy of the previous implementation on random inputs, ties (equal lengths, equal and opposite
embeddings, duplicated documents), documents of exactly seq_len and longer, empty and one-document
inputs, and many small clusters (the merge step's hard cases)."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.data.builder.pack import Packing, pack
from longctx.data.builder.pack_search import fill_gaps, group_clusters

# ----------------------------------------------------------------------------------------------
# The implementation before pack_search.py, frozen (pack.py at 0a72f4a): only the DataError became
# a ValueError.

MIN_GROUP_SAMPLES = 4
SAMPLE, DOC, START, LENGTH = range(4)


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


def reference_datasculpt(lengths: np.ndarray, seq_len: int, embeddings: np.ndarray, clusters: np.ndarray,
                    breaks=None, strong=None) -> Packing:
    """Relevance x capacity greedy within clusters, longest first, then the merge step."""
    lengths = np.asarray(lengths, dtype=np.int64)
    emb = np.asarray(embeddings, dtype=np.float32)
    clusters = np.asarray(clusters)
    if len(emb) != len(lengths) or len(clusters) != len(lengths):
        raise ValueError(f"datasculpt packing needs one embedding and one cluster per document; got "
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
    # clusters (the near clusters merged until a group can fill `MIN_GROUP_SAMPLES` samples)
    overflow, next_sample = _pack_groups(rest, segs, next_sample, seq_len, emb)
    groups = _group_clusters(overflow, clusters, emb, seq_len)
    overflow, next_sample = _pack_groups(groups, segs, next_sample, seq_len, emb)
    return _finish(_merge(segs, overflow, seq_len, emb), seq_len)


def _pack_groups(groups, segs, next_sample: int, seq_len: int, emb) -> tuple[list, int]:
    """Each group (longest first) into as many samples as it fills completely (rounding up would
    leave most groups a partly filled sample), appended to `segs` from `next_sample` on. Returns
    the pieces that did not fit, and the next free sample."""
    overflow = []
    for c in sorted(groups):
        group = _longest_first(groups[c])
        k = sum(p[2] for p in group) // seq_len
        if k == 0:
            overflow.extend(group)
            continue
        placed, spill = _greedy(group, k, seq_len, emb)
        segs.extend((next_sample + w, d, s, n) for w, d, s, n in placed)
        next_sample += k
        overflow.extend(spill)
    return overflow, next_sample


MIN_GROUP_SAMPLES = 4


def _group_clusters(pieces, clusters: np.ndarray, emb: np.ndarray, seq_len: int) -> dict[int, list]:
    """Pieces grouped by cluster, then the smallest group repeatedly merged into the group with the
    most similar centroid, until every group holds MIN_GROUP_SAMPLES samples of tokens (or one is left)."""
    groups: dict[int, list] = {}
    for p in pieces:
        groups.setdefault(int(clusters[p[0]]), []).append(p)
    tokens = {c: sum(p[2] for p in g) for c, g in groups.items()}
    sums = {c: emb[[p[0] for p in g]].sum(0) for c, g in groups.items()}
    while len(groups) > 1:
        small = min(groups, key=lambda c: (tokens[c], c))
        if tokens[small] >= MIN_GROUP_SAMPLES * seq_len:
            break
        others = [c for c in groups if c != small]
        cent = np.stack([sums[c] for c in others])
        cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
        target = others[int(np.argmax(cent @ sums[small]))]
        groups[target].extend(groups.pop(small))
        tokens[target] += tokens.pop(small)
        sums[target] = sums[target] + sums.pop(small)
    return groups


def _merge(segs, overflow, seq_len: int, emb: np.ndarray, dissolve_below: float = 0.9, tight: float = 0.5,
           related: float = 0.3):
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
    rest = []
    if ids:
        remaining = np.array([seq_len - fill[w] for w in ids], dtype=np.int64)
        centroid = np.stack([emb[members[w]].sum(0) for w in ids]).astype(np.float32)
        placed, rest = reference_fill_gaps(pool, remaining, centroid, emb, tight, related)
        kept.extend((ids[w], d, s, n) for w, d, s, n in placed)
    else:
        rest = pool
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
# The comparison


def assert_same(lengths, seq_len, emb, clusters, breaks=None, strong=None):
    want = reference_datasculpt(np.array(lengths, dtype=np.int64), seq_len, emb, clusters, breaks, strong)
    got = pack("datasculpt", np.array(lengths, dtype=np.int64), seq_len, emb, clusters, breaks, strong)
    assert got.num_samples == want.num_samples
    np.testing.assert_array_equal(got.segments, want.segments)
    return got


def embeddings(n, rng, kind, dim=8):
    """Unit vectors of several kinds: random; around a few topics; drawn from a handful of vectors
    (exact ties everywhere); pairs of opposite vectors (centroids that sum to zero); with zero rows."""
    if n == 0:
        return np.zeros((0, dim), np.float32)
    if kind == "random":
        e = rng.normal(size=(n, dim))
    elif kind == "topics":
        centres = rng.normal(size=(max(1, n // 20), dim))
        e = centres[rng.integers(0, len(centres), size=n)] + 0.3 * rng.normal(size=(n, dim))
    elif kind == "few":
        e = rng.normal(size=(3, dim))[rng.integers(0, 3, size=n)]
    elif kind == "opposite":
        v = rng.normal(size=((n + 1) // 2, dim))
        e = np.concatenate([v, -v])[rng.permutation(2 * len(v))][:n]
    else:  # "zeros": some documents without an embedding
        e = rng.normal(size=(n, dim))
        e[rng.random(n) < 0.3] = 0
    norm = np.linalg.norm(e, axis=1, keepdims=True)
    return (e / np.where(norm > 0, norm, 1)).astype(np.float32)


def random_case(rng, n, seq_len, kind, num_clusters, with_breaks):
    lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 6), 1.2, size=n)).astype(np.int64)
    if n:
        lengths[rng.random(n) < 0.05] = seq_len  # exactly one sample
        same = rng.random(n) < 0.3
        lengths[same] = lengths[same][0] if same.any() else 1  # many equal lengths
    emb = embeddings(n, rng, kind)
    clusters = rng.integers(0, num_clusters, size=n)
    breaks = strong = None
    if with_breaks:
        breaks = [np.sort(rng.choice(np.arange(1, m), size=min(m - 1, m // 5), replace=False)) if m > 1
                  else np.zeros(0, np.int64) for m in lengths.tolist()]
        strong = [b[::4] for b in breaks]
    return lengths, emb, clusters, breaks, strong


KINDS = ["random", "topics", "few", "opposite", "zeros"]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(n=st.integers(0, 120), seq_len=st.integers(1, 300), seed=st.integers(0, 10**6), kind=st.sampled_from(KINDS),
       num_clusters=st.integers(1, 40), with_breaks=st.booleans())
def test_same_packing_as_before_on_random_inputs(n, seq_len, seed, kind, num_clusters, with_breaks):
    rng = np.random.default_rng(seed)
    lengths, emb, clusters, breaks, strong = random_case(rng, n, seq_len, kind, num_clusters, with_breaks)
    assert_same(lengths, seq_len, emb, clusters, breaks, strong)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_same_packing_as_before_on_thousands_of_documents(kind, seed):
    """Large enough that the merge step fills hundreds of gaps and merges hundreds of groups."""
    rng = np.random.default_rng(seed)
    n = 3000
    lengths, emb, clusters, breaks, strong = random_case(rng, n, 2048, kind, 300, with_breaks=True)
    assert_same(lengths, 2048, emb, clusters, breaks, strong)


def test_edge_inputs():
    rng = np.random.default_rng(0)
    e1 = embeddings(1, rng, "random")
    assert_same([], 16, np.zeros((0, 8), np.float32), np.zeros(0, np.int64))
    assert_same([5], 16, e1, [0])
    assert_same([16], 16, e1, [0])  # exactly a sample
    assert_same([40], 16, e1, [3])  # longer: cut
    e = embeddings(50, rng, "few")
    assert_same([16] * 50, 16, e, rng.integers(0, 5, size=50))
    assert_same([3] * 50, 16, e, rng.integers(0, 5, size=50))  # all equal
    assert_same([3] * 50, 16, e, np.zeros(50, np.int64))  # one cluster
    assert_same([3] * 50, 16, np.zeros((50, 8), np.float32), np.arange(50))  # no embedding at all


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # what both make of NaN and inf: invalid value, overflow
@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e30, 1e-30])
def test_embeddings_out_of_range_pack_as_before(bad):
    """NaN, inf, huge or tiny values: the full scans, whatever they make of them."""
    rng = np.random.default_rng(1)
    lengths, emb, clusters, _, _ = random_case(rng, 400, 256, "topics", 40, with_breaks=False)
    emb = emb.copy()
    emb[rng.random(len(emb)) < 0.1] = bad
    assert_same(lengths, 256, emb, clusters)
    assert_same(lengths, 256, emb * np.float32(bad) if np.isfinite(bad) and bad < 1 else emb, clusters)


@pytest.mark.parametrize("kind", KINDS)
def test_group_clusters_as_before_with_ties(kind):
    """Many groups of equal tokens and centroids (the heap's and the nearest group's tie rules)."""
    rng = np.random.default_rng(2)
    n = 2000
    emb = embeddings(n, rng, kind)
    clusters = rng.integers(0, 600, size=n)
    pieces = [(d, 0, int(rng.choice([5, 10, 20]))) for d in rng.permutation(n).tolist()]
    want = _group_clusters(pieces, clusters, emb, 64)
    got = group_clusters(pieces, clusters, emb, 64)
    assert list(got) == list(want)
    assert got == want


def reference_fill_gaps(pool, remaining, centroid, emb, tight=0.5, related=0.3):
    """The frozen _merge's gap-filling loop (it calls this), tested on its own too."""
    norm = np.linalg.norm(centroid, axis=1)
    placed, rest = [], []
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
        placed.append((w, d, s, n))
    return placed, rest


@pytest.mark.parametrize("step", [-2, -1, 0, 1, 2])
def test_fill_gaps_at_the_related_threshold(step):
    """A cosine a float32 ulp or two either side of `related` (0.3): placed exactly when it was."""
    x = np.float32(0.3)
    for _ in range(abs(step)):
        x = np.nextafter(x, np.float32(np.sign(step)))
    emb = np.array([[x, np.sqrt(1 - np.float32(x) ** 2)], [1, 0]], dtype=np.float32)
    want = reference_fill_gaps([(0, 0, 6)], np.array([10, 9]), np.array([[1, 0], [0, -1]], np.float32), emb)
    got = fill_gaps([(0, 0, 6)], np.array([10, 9]), np.array([[1, 0], [0, -1]], np.float32), emb, 0.5, 0.3)
    assert got == want


@pytest.mark.parametrize("kind", KINDS)
def test_fill_gaps_as_before_with_ties(kind):
    """Many samples with equal gaps and centroids, pieces of equal lengths."""
    rng = np.random.default_rng(3)
    emb = embeddings(3000, rng, kind)
    rows = 800
    centroid = np.stack([emb[rng.integers(0, 3000, size=rng.integers(1, 4))].sum(0) for _ in range(rows)])
    remaining = rng.choice([4, 8, 12, 16, 30], size=rows)
    pool = sorted(((int(d), 0, int(n)) for d, n in zip(rng.integers(0, 3000, 600), rng.choice([2, 4, 6, 8, 15], 600))),
                  key=lambda p: (-p[2], p[0], p[1]))
    want = reference_fill_gaps(pool, remaining.copy(), centroid.copy(), emb)
    got = fill_gaps(pool, remaining.copy(), centroid.copy(), emb, 0.5, 0.3)
    assert got == want
