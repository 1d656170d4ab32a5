"""Split a packed sequence over context ranks by documents, so that every rank gets the same
attention work under a document (causal, same-document) mask.

The work of a context rank = the (query, key) pairs it computes = for each query token it holds,
the keys of the same document at or before its position, wherever they live. A token at offset o
of its document has o + 1 of them, so rank work = sum over its tokens of (offset + 1). Zigzag
(layouts.py) balances one causal sequence, not a packed one: the busiest rank of a sample with a
few documents does up to ~2x the mean.

`docs_balanced_indices` (pure numpy, deterministic, ~1-5 ms per call):

1. long documents are cut head-tail: into 2 ctx near-equal chunks, rank i takes chunks i and
   2 ctx - 1 - i, so every rank gets the same share of that document's work (the rounding tokens go
   round-robin over the ranks, so the token counts stay within one of each other). Long = largest
   first, while a document's work exceeds `alpha` x the per-rank share of the work of itself and all
   smaller documents (the pool that whole-document placement has to balance);
2. the other documents go whole, largest first, to the rank (with room for them) whose projected
   final work - its work so far + this document + its remaining room filled at the mean density
   (work per token) of the documents still to place - is least; a document that fits no rank is cut
   in two, one piece filling a rank exactly (head or tail, whichever pair balances best);
3. the tail of tiny documents (each below `TINY` of a rank's share, or past the `GREEDY_DOCS_MAX` largest) is
   laid out in a well-mixed order (bit-reversed rank of length) and cut into the ranks' remaining
   room, so each rank gets that pool at its mean density (a cut document: two pieces);
4. this runs for a few `alpha`s (`ALPHAS`), zigzag is scored too, and among the assignments whose
   maximal rank work is within `TIE` of the least, the one with the fewest runs wins.

Every rank ends with exactly seq / ctx tokens, in increasing position order, cut into `head`
contiguous pieces (head rank j holds piece j), as in the zigzag layout.
"""

from __future__ import annotations

import numpy as np

from .layouts import doc_runs, rank_runs, zigzag_positions

# head-tail thresholds tried (step 1)
ALPHAS = (0.25, 0.5, 1.0, 2.0)
# assignments whose maximal rank work is within this fraction of the best are as good: fewest runs
TIE = 0.005
# documents placed one by one (step 2): at most GREEDY_DOCS_MAX, each above TINY x a rank's share of the work
GREEDY_DOCS_MAX = 256
TINY = 1e-3


def _tri(n):
    return n * (n + 1) // 2


def _piece_work(off, n):
    """Work of the n tokens at offsets off .. off + n - 1 of a document (ints or int64 arrays)."""
    return _tri(off + n) - _tri(off)


def _check(seq: int, ctx: int, head: int) -> None:
    if ctx < 1 or head < 1:
        raise ValueError(f"ctx and head must be >= 1, got ctx={ctx}, head={head}")
    if seq % (ctx * head):
        raise ValueError(f"sequence length {seq} is not divisible by ctx x head = {ctx} x {head}")


def _bit_reversed_order(n: int) -> np.ndarray:
    """A permutation of range(n) in which every stretch of it samples the whole range evenly."""
    if n <= 2:
        return np.arange(n)
    bits = int(n - 1).bit_length()
    i = np.arange(n, dtype=np.int64)
    rev = np.zeros(n, dtype=np.int64)
    for b in range(bits):
        rev |= ((i >> b) & 1) << (bits - 1 - b)
    return np.argsort(rev, kind="stable")


class _Pieces:
    """Pieces (rank, doc, global start, length) of an assignment being built."""

    def __init__(self):
        self.rank, self.doc, self.start, self.length = [], [], [], []

    def add(self, rank: int, doc: int, start: int, length: int) -> None:
        self.rank.append(rank)
        self.doc.append(doc)
        self.start.append(start)
        self.length.append(length)

    def arrays(self, extra=()) -> np.ndarray:
        """[n, 4] int64 (rank, doc, start, length), with extra [k, 4] arrays, sorted by rank, start."""
        own = np.array([self.rank, self.doc, self.start, self.length], dtype=np.int64).T.reshape(-1, 4)
        arr = np.concatenate([own, *extra]) if extra else own
        arr = arr[arr[:, 3] > 0]
        return arr[np.lexsort((arr[:, 2], arr[:, 0]))]


def _num_long(Wd: np.ndarray, ctx: int, alpha: float) -> int:
    """How many of the documents (work Wd, decreasing) are cut head-tail for threshold `alpha`."""
    pool = np.cumsum(Wd[::-1].astype(np.float64))[::-1]
    small = np.flatnonzero(Wd <= alpha * pool / ctx)
    return int(small[0]) if small.size else len(Wd)


def _assign(starts: np.ndarray, lengths: np.ndarray, order: np.ndarray, ctx: int, room: int, n_long: int):
    """One assignment, the n_long longest documents cut head-tail: (pieces [n, 4] sorted by rank and
    start, work per rank [ctx]). `order`: documents by decreasing length (ties: position order)."""
    L = lengths[order]
    Wd = _tri(L)
    share = float(Wd.sum()) / ctx
    long_pieces, work, cap = _cut_head_tail(starts, lengths, order[:n_long], ctx, room)
    # 2. whole documents, largest first, to the least projected final work
    short, Ws = order[n_long:], Wd[n_long:]
    n_greedy = min(GREEDY_DOCS_MAX, int(np.searchsorted(-Ws, -TINY * share, side="right")))
    pieces = _Pieces()
    _place_whole(pieces, work, cap, starts, lengths, short[:n_greedy], Ws[:n_greedy],
                 rem_tok=int(L[n_long:].sum()), rem_work=int(Ws.sum()))
    # 3. the tiny rest, well mixed, cut into the ranks' remaining room
    extra_pieces = [long_pieces]
    tail = short[n_greedy:]
    if tail.size:
        fill, tail_work = _fill_tail(starts, lengths, tail[_bit_reversed_order(tail.size)], cap, ctx)
        extra_pieces.append(fill)
        work = (np.asarray(work) + tail_work).tolist()
    return pieces.arrays(extra_pieces), np.asarray(work, dtype=np.int64)


def _cut_head_tail(starts, lengths, lg, ctx: int, room: int):
    """Step 1, vectorised: documents `lg` cut into 2 ctx chunks, rank i taking chunks i and 2 ctx - 1 - i;
    extra (rounding) tokens go to ranks ptr, ptr + 1, ... (early chunks first, then late ones), ptr
    running on over the documents. (pieces [n, 4], work per rank, room left per rank)."""
    c2 = 2 * ctx
    Ll = lengths[lg]
    base, extra = Ll // c2, Ll % c2
    ptr = (np.cumsum(extra) - extra) % ctx
    q = (np.arange(ctx)[None, :] - ptr[:, None]) % ctx
    early = base[:, None] + (q < extra[:, None])
    late = base[:, None] + (q + ctx < extra[:, None])
    sizes = np.concatenate([early, late[:, ::-1]], axis=1)                # chunks 0 .. 2c-1
    offs = np.cumsum(sizes, axis=1) - sizes
    chunk_rank = np.concatenate([np.arange(ctx), np.arange(ctx)[::-1]])
    long_pieces = np.stack([np.broadcast_to(chunk_rank, sizes.shape), np.broadcast_to(lg[:, None], sizes.shape),
                            starts[lg][:, None] + offs, sizes], axis=-1).reshape(-1, 4)
    pw = _piece_work(offs, sizes).ravel()
    work = np.bincount(long_pieces[:, 0], weights=pw, minlength=ctx).astype(np.int64).tolist()
    cap = (room - np.bincount(long_pieces[:, 0], weights=long_pieces[:, 3], minlength=ctx).astype(np.int64)).tolist()
    return long_pieces, work, cap


def _place_whole(pieces: _Pieces, work: list, cap: list, starts, lengths, docs, doc_work, rem_tok: int,
                 rem_work: int) -> None:
    """Step 2: each document (largest first) to the rank (with room) of least projected final work:
    its work so far + this document + its remaining room filled at the mean density `rho` of the
    documents still to place. `work` and `cap` are updated in place."""
    for d, s, n, w in zip(docs.tolist(), starts[docs].tolist(), lengths[docs].tolist(), doc_work.tolist()):
        rem_tok -= n
        rem_work -= w
        rho = rem_work / rem_tok if rem_tok else 0.0
        off = 0  # offset of the part still to place
        while n:
            best = min((r for r in range(len(cap)) if cap[r] >= n),
                       key=lambda r: work[r] + w + (cap[r] - n) * rho, default=-1)
            if best >= 0:
                pieces.add(best, d, s + off, n)
                work[best] += w
                cap[best] -= n
                break
            choice = _best_cut(work, cap, off, n, w, rho)
            if choice is not None:  # fits no rank whole: cut in two so that one piece fills a rank exactly
                a, b, a_head, wa = choice
                ca = cap[a]
                pieces.add(a, d, s + off if a_head else s + off + n - ca, ca)
                pieces.add(b, d, s + off + ca if a_head else s + off, n - ca)
                work[a] += wa
                work[b] += w - wa
                cap[a] = 0
                cap[b] -= n - ca
                break
            # no two ranks hold it: fill the roomiest rank with its head, place the rest next round
            a = max(range(len(cap)), key=lambda r: cap[r])
            ca = cap[a]
            wa = _piece_work(off, ca)
            pieces.add(a, d, s + off, ca)
            work[a] += wa
            cap[a] = 0
            off += ca
            n -= ca
            w -= wa


def _best_cut(work: list, cap: list, off: int, n: int, w: int, rho: float):
    """The cut of a document part (n tokens at offset `off`, work w) into a piece filling rank a
    exactly and the rest on rank b, head or tail first, of least projected maximal work:
    (a, b, a takes the head, a's work), or None when no two ranks hold it."""
    choice, best = None, None
    for a, ca in enumerate(cap):
        if ca <= 0:
            continue
        for b in range(len(cap)):
            if b == a or cap[b] < n - ca:
                continue
            for a_head in (True, False):
                wa = _piece_work(off, ca) if a_head else _piece_work(off + n - ca, ca)
                p = max(work[a] + wa, work[b] + w - wa + (cap[b] - (n - ca)) * rho)
                if best is None or p < best:
                    choice, best = (a, b, a_head, wa), p
    return choice


def _fill_tail(starts, lengths, tail, cap: list, ctx: int):
    """Step 3: the tiny documents, in the given (well-mixed) order, laid end to end and cut into the
    ranks' remaining room: (pieces [n, 4], work added per rank [ctx])."""
    tl = lengths[tail]
    a = np.cumsum(tl) - tl                                   # each document's span in the stream
    edges = np.cumsum(cap) - np.asarray(cap)                 # each rank's span in the stream
    cuts = np.unique(np.concatenate([a, edges[np.asarray(cap) > 0]]))
    seg_len = np.diff(np.append(cuts, a[-1] + tl[-1]))
    j = np.searchsorted(a, cuts, side="right") - 1
    r = np.searchsorted(edges, cuts, side="right") - 1
    # ranks with no room share an edge with the next one: searchsorted picks the last (with room)
    off = cuts - a[j]
    fill = np.stack([r, tail[j], starts[tail[j]] + off, seg_len], axis=1)
    return fill, np.bincount(r, weights=_piece_work(off, seg_len), minlength=ctx)


def _num_runs(arr: np.ndarray) -> int:
    """Runs of sorted pieces: a piece continuing the previous one (same rank and document) is no new run."""
    if len(arr) == 0:
        return 0
    cont = (arr[1:, 0] == arr[:-1, 0]) & (arr[1:, 1] == arr[:-1, 1]) & (arr[1:, 2] == arr[:-1, 2] + arr[:-1, 3])
    return int(len(arr) - cont.sum())


def _positions(arr: np.ndarray, ctx: int, room: int) -> np.ndarray:
    """[ctx, room] positions of each rank, ascending, from pieces sorted by (rank, start)."""
    s, n = arr[:, 2], arr[:, 3]
    before = np.cumsum(n) - n
    pos = np.repeat(s - before, n) + np.arange(int(n.sum()), dtype=np.int64)
    return pos.reshape(ctx, room)


def docs_balanced_indices(doc_ids: np.ndarray, ctx: int, head: int, alphas=ALPHAS, tie: float = TIE) -> np.ndarray:
    """doc_ids: int64 [seq] of ONE sequence (documents are contiguous runs; ids need not be sorted).
    Returns int64 [ctx, head, seq // (ctx*head)]: the global positions each (ctx rank, head rank) holds,
    sorted ascending within each ctx rank and cut into `head` contiguous pieces of that sorted list
    (head rank j holds the j-th piece), so that concatenating the head pieces of ctx rank i gives
    rank i's tokens in increasing position order.

    The maximal rank work (`rank_work`) is about the mean (see the module docstring); `alphas` are the
    head-tail thresholds tried, `tie` the balance given up for fewer runs."""
    doc_ids = np.asarray(doc_ids).ravel()
    seq = doc_ids.size
    _check(seq, ctx, head)
    room = seq // ctx
    if ctx == 1 or seq == 0:
        return np.arange(seq, dtype=np.int64).reshape(ctx, head, seq // (ctx * head))
    starts, lengths = doc_runs(doc_ids)
    order = np.argsort(-lengths, kind="stable")

    candidates = []  # (max work, runs, ctx-rank positions [ctx, room] (zigzag) or pieces [n, 4])
    if seq % (2 * ctx) == 0:
        zz = zigzag_positions(seq, ctx, 1)[:, 0]
        tok_work = np.arange(seq, dtype=np.int64) - np.repeat(starts, lengths) + 1
        candidates.append((int(tok_work[zz].sum(axis=1).max()), int(rank_runs(doc_ids, zz).sum()), zz, True))
    Wd = _tri(lengths[order])
    for n_long in sorted({_num_long(Wd, ctx, alpha) for alpha in alphas}):
        arr, work = _assign(starts, lengths, order, ctx, room, n_long)
        candidates.append((int(work.max()), _num_runs(arr), arr, False))
    best_max = min(c[0] for c in candidates)
    near = [c for c in candidates if c[0] <= best_max * (1 + tie)]
    _, _, choice, is_positions = min(near, key=lambda c: (c[1], c[0]))  # fewest runs, then least work
    pos = choice if is_positions else _positions(choice, ctx, room)
    return pos.reshape(ctx, head, room // head)
