"""From scanned shards to a store part: dedup -> embed -> cluster -> pack -> write, in bounded memory.

The scan (scan.py) left every document's text, tokens, split points, hashes and head features on
disk. This stage reads them back in input order and keeps in memory only what grows slowly with
the corpus: a byte or two per document (kept, split), 8 bytes per exact hash and 12 per LSH band
for dedup, the k-means centroids. Everything that grows with the tokens stays on disk and is read
a group at a time:

- dedup: `Deduper` over the documents in input order (the first occurrence is kept), each LSH
  candidate confirmed by the true Jaccard of the two texts' shingle sets;
- embed: TF-IDF of the head features with the idf of every kept document, reduced to 128
  dimensions by a truncated SVD fitted on an evenly spaced sample of up to `FIT_DOCS` documents, then
  applied chunk by chunk (written to `emb.npy` in the work directory);
- cluster: spherical k-means over all kept documents, chunk by chunk, near
  clusters merged;
- pack: clusters (datasculpt) or runs of documents in input order (bfd, concat) are taken a group
  of about `group_tokens` tokens at a time; each group is packed on its own and its samples are
  appended to the part's files (spill.NpyAppender) as soon as it is done.

`group_tokens` follows the memory bound; a group's last samples are its only partly filled ones,
so the fill rate is within ~samples per group of one global packing.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError
from . import spill
from . import store as st
from .cluster import default_k, merge_centroids
from .dedup import Deduper
from .holdout import eval_rank, is_eval_doc, piece_name
from .pack import DOC, LENGTH, SAMPLE, START, Packing, homogeneity, pack, split_points
from .scan import ScannedShard

FIT_DOCS = 2048
CHUNK = 2048
OPEN_READERS = 64
TRANSFORM_CHUNK = 256  # documents per sparse TF-IDF block (~3,000 features each)
DIM = 128


@dataclass
class Corpus:
    """The scanned shards of a build as one list of documents (read order), read on demand."""
    shards: list[ScannedShard]
    token_dtype: str
    starts: np.ndarray = field(init=False)  # first document of each shard
    _readers: OrderedDict = field(default_factory=OrderedDict, init=False)  # the most recently used

    def __post_init__(self):
        self.starts = np.cumsum([0] + [s.n for s in self.shards])

    @property
    def n(self) -> int:
        return int(self.starts[-1])

    def locate(self, doc: int) -> tuple[int, int]:
        s = int(np.searchsorted(self.starts, doc, side="right") - 1)
        return s, doc - int(self.starts[s])

    def reader(self, s: int, what: str) -> spill.RaggedReader:
        """An open reader, kept among the last OPEN_READERS used: each holds a file and its shard's
        offsets, so keeping every shard's would grow with the corpus (and exhaust file handles)."""
        key = (s, what)
        if key in self._readers:
            self._readers.move_to_end(key)
        else:
            self._readers[key] = self.shards[s].ragged(what)
            if len(self._readers) > OPEN_READERS:
                self._readers.popitem(last=False)[1].close()
        return self._readers[key]

    def get(self, what: str, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        s, j = self.locate(doc)
        return self.reader(s, what).get(j, start, stop)

    def text(self, doc: int) -> str:
        s, j = self.locate(doc)
        return self.reader(s, "text").raw(j).decode("utf-8", "surrogatepass")

    def per_doc(self, fn) -> np.ndarray:
        return np.concatenate([fn(sh) for sh in self.shards]) if self.shards else np.zeros(0)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


# ----------------------------------------------------------------------------------------------
# dedup


def dedup(corpus: Corpus, mode: str, threshold: float, limit: int, seen=None, progress=None) -> tuple[np.ndarray, dict]:
    """keep mask over the corpus's documents (only the first `limit` are read when limit > 0).
    Signatures are read a shard at a time; a candidate's from another shard is one row read from
    its file (not a memory map of every shard, whose touched pages would count as resident)."""

    def sig_of(doc: int):
        s, j = corpus.locate(doc)
        return np.array(corpus.shards[s].sigs()[j])

    dd = Deduper(mode, threshold, text_of=corpus.text, sig_of=sig_of)
    if seen is not None and seen[0] is not None:
        dd.seed(*seen)
    n = min(corpus.n, limit) if limit else corpus.n
    keep = np.zeros(corpus.n, dtype=bool)
    for s, sh in enumerate(corpus.shards):
        base = int(corpus.starts[s])
        if base >= n:
            break
        sigs = np.load(sh.path / "sigs.npy") if sh.minhash else None
        for j, h in enumerate(sh.hashes()[:n - base].tolist()):
            keep[base + j] = dd.check(base + j, h, None if sigs is None else sigs[j]) is None
        if progress is not None:
            progress.update(sh.n)
    return keep, {"documents_read": n, "exact_duplicates": dd.exact, "near_duplicates": dd.near,
                  "kept": int(keep.sum()), "near_candidates_checked": dd.checked,
                  "near_estimate_disagreed": dd.disagreed,
                  "index_mb": round((dd.lsh.nbytes + dd.hashes.nbytes) / 1e6, 2)}


# ----------------------------------------------------------------------------------------------
# embed and cluster


class Embeddings:
    """Unit-length document vectors [n, DIM] in a file, rows read with pread."""

    def __init__(self, path: Path):
        self.path = path
        arr = np.load(path, mmap_mode="r")
        self.n, self.dim, self.offset = arr.shape[0], arr.shape[1], arr.offset
        del arr
        self.f = open(path, "rb")

    def rows(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        row = self.dim * 4
        # contiguous runs in one read each
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        for run in np.split(np.arange(len(ids)), breaks):
            if len(run) == 0:
                continue
            self.f.seek(self.offset + int(ids[run[0]]) * row)
            out[run] = np.frombuffer(self.f.read(row * len(run)), dtype=np.float32).reshape(len(run), self.dim)
        return out

    def chunks(self, size: int = CHUNK):
        for a in range(0, self.n, size):
            yield a, self.rows(np.arange(a, min(self.n, a + size)))

    def close(self) -> None:
        self.f.close()


def _tfidf_rows(corpus: Corpus, docs: np.ndarray, idf: np.ndarray, col_of: np.ndarray | None = None):
    """Sublinear TF-IDF rows, L2-normalised (scikit-learn's TfidfTransformer defaults), as CSR over
    the feature buckets, or with `col_of` (bucket -> column, -1 = dropped) over those columns."""
    import scipy.sparse as sp

    from .features import BUCKETS

    indptr, indices, data = [0], [], []
    for d in docs.tolist():
        idx = corpus.get("feat_idx", d).astype(np.int32)
        val = ((1.0 + np.log(corpus.get("feat_val", d))) * idf[idx]).astype(np.float32)
        norm = np.sqrt((val ** 2).sum())
        if norm > 0:
            val /= norm
        if col_of is not None:
            idx = col_of[idx]
            val, idx = val[idx >= 0], idx[idx >= 0]
        indices.append(idx)
        data.append(val)
        indptr.append(indptr[-1] + len(idx))
    width = BUCKETS if col_of is None else int(col_of.max()) + 1
    return sp.csr_matrix((np.concatenate(data) if data else np.zeros(0, np.float32),
                          np.concatenate(indices) if indices else np.zeros(0, np.int32),
                          np.asarray(indptr, dtype=np.int64)), shape=(len(docs), width))


def _unit(z: np.ndarray) -> np.ndarray:
    from .embed import _unit as unit

    return unit(z.astype(np.float32))


def fit_documents(memory: int) -> int:
    """Documents the SVD is fitted on: a document's sparse TF-IDF row and its copies during the
    fit take ~150 KB; a quarter of the memory bound goes to them."""
    return int(np.clip(memory // 4 // (150 << 10), 256, FIT_DOCS))


def svd_components(x, k: int) -> np.ndarray:
    """The top-k right singular vectors [k', columns] (k' <= k: only nonzero singular values) of
    sparse `x`, which has few rows (the fitted sample) and many columns: from the eigenvectors of
    the small Gram matrix x x^T, v_i = x^T u_i / s_i. Exact, and it never holds more than one
    dense [columns, k] block (a randomised SVD holds several; scikit-learn's costs ~150 MB of
    imports on top)."""
    gram = np.asarray((x @ x.T).todense(), dtype=np.float64)
    w, u = np.linalg.eigh(gram)
    top = np.argsort(w)[::-1][:k]
    w, u = w[top], u[:, top]
    nonzero = w > 1e-9 * max(float(w[0]), 1e-30) if len(w) else np.zeros(0, bool)
    w, u = w[nonzero], u[:, nonzero]
    return np.asarray(x.T @ (u / np.sqrt(w)).astype(np.float32)).T.astype(np.float32)


def embed(corpus: Corpus, kept: np.ndarray, out: Path, seed: int, model: str = "",
          memory: int = 2 << 30) -> tuple[Embeddings, dict]:
    """Embeddings of the kept documents, written to `out`."""
    writer = spill.NpyAppender(out, np.float32, (DIM,))
    n = len(kept)
    if model:  # a local sentence-transformers model over the text heads, chunk by chunk
        from .embed import MAX_CHARS, embed_model

        for a in range(0, n, CHUNK):
            z = embed_model([corpus.text(d)[:MAX_CHARS] for d in kept[a:a + CHUNK].tolist()], model)
            out_rows = np.zeros((len(z), DIM), np.float32)
            out_rows[:, :min(DIM, z.shape[1])] = z[:, :DIM]
            writer.append(_unit(out_rows))
        writer.close()
        return Embeddings(out), {"dim": DIM, "model": model}
    from .features import BUCKETS

    df = np.zeros(BUCKETS, dtype=np.int64)
    for d in kept.tolist():
        df[corpus.get("feat_idx", d)] += 1
    idf = (np.log((1 + n) / (1 + df)) + 1.0).astype(np.float32)
    fit = kept[np.unique(np.linspace(0, n - 1, min(n, fit_documents(memory))).astype(np.int64))] if n else kept
    # only the features the sample has: the others get no weight in the components anyway
    cols = np.unique(np.concatenate([corpus.get("feat_idx", d) for d in fit.tolist()] or [np.zeros(0, np.uint16)]))
    col_of = np.full(BUCKETS, -1, dtype=np.int32)
    col_of[cols] = np.arange(len(cols), dtype=np.int32)
    x = _tfidf_rows(corpus, fit, idf, col_of)
    k = min(DIM, len(fit) - 1, len(cols) - 1)
    comp = svd_components(x, k) if k >= 1 and x.nnz else None
    k = 0 if comp is None else comp.shape[0]
    del x
    for a in range(0, n, TRANSFORM_CHUNK):
        rows = _tfidf_rows(corpus, kept[a:a + TRANSFORM_CHUNK], idf, col_of)
        z = np.zeros((rows.shape[0], DIM), np.float32)
        if k:
            z[:, :k] = rows @ comp.T
        else:
            z[:, 0] = 1.0
        writer.append(_unit(z))
    writer.close()
    return Embeddings(out), {"dim": DIM, "model": "hashed-tfidf-svd", "fit_documents": int(len(fit))}


def kmeans(emb: Embeddings, k: int, seed: int, memory: int, iters: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (cosine; the embeddings are unit vectors), Lloyd's iterations over chunks
    of rows: memory is the centroids plus one chunk's similarities, whatever the corpus. Returns the
    labels and each cluster's sum of rows under them (the last iteration's, so no further pass)."""
    rng = np.random.default_rng(seed)
    cent = emb.rows(np.sort(rng.choice(emb.n, size=k, replace=False)))
    chunk = int(np.clip(memory // 16 // (k * 4), 64, 8192))
    labels = np.full(emb.n, -1, dtype=np.int64)
    for _ in range(iters):
        sums = np.zeros((k, emb.dim), dtype=np.float64)
        changed = 0
        for a, rows in emb.chunks(chunk):
            lab = np.argmax(rows @ cent.T, axis=1)
            changed += int((labels[a:a + len(rows)] != lab).sum())
            labels[a:a + len(rows)] = lab
            np.add.at(sums, lab, rows)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        cent = np.where(norms > 0, sums / np.maximum(norms, 1e-12), cent).astype(np.float32)
        if changed <= emb.n // 1000:
            break
    return labels, sums


def cluster(emb: Embeddings, lengths: np.ndarray, seq_len: int, k: int, seed: int,
            memory: int = 2 << 30) -> tuple[np.ndarray, dict]:
    n = emb.n
    k = k or default_k(n, int(lengths.sum()), seq_len)
    k = max(1, min(k, n))
    if k <= 1:
        return np.zeros(n, dtype=np.int64), {"clusters": 1}
    labels, sums = kmeans(emb, k, seed, memory)
    used = np.unique(labels)
    lookup = np.zeros(k, dtype=np.int64)
    lookup[used] = merge_centroids(sums[used])
    labels = lookup[labels]
    return labels, {"clusters": int(labels.max()) + 1, "k_means": k}


# ----------------------------------------------------------------------------------------------
# eval split: whole documents, or pieces of documents longer than a sample


@dataclass
class Items:
    """What one split packs: (document, start, length) items in document order."""
    doc: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)

    def add(self, d: int, s: int, n: int) -> None:
        self.doc.append(d)
        self.start.append(s)
        self.length.append(n)

    def arrays(self):
        return (np.asarray(self.doc, np.int64), np.asarray(self.start, np.int64), np.asarray(self.length, np.int64))


def split_items(corpus: Corpus, kept: np.ndarray, names: list[str], lengths: np.ndarray, seq_len: int,
                eval_fraction: float, log) -> tuple[dict[str, Items], np.ndarray, dict]:
    """Train and eval items; per kept document 0 (train), 1 (eval) or 2 (both: pieces in each)."""
    items = {"train": Items(), "eval": Items()}
    where = np.zeros(len(kept), dtype=np.int8)
    lowest = None  # (hash rank, document, piece bounds) of the first candidate for the eval split
    pieces_total = 0
    for k, (d, name, n) in enumerate(zip(kept.tolist(), names, lengths.tolist())):
        if n <= seq_len or eval_fraction == 0:
            pieces = [(0, n, name)]
        else:
            cuts = split_points(n, seq_len, corpus.get("breaks", d).astype(np.int64),
                                corpus.get("strong", d).astype(np.int64))
            pieces = [(a, b - a, piece_name(name, p)) for p, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
        pieces_total += len(pieces)
        flags = [is_eval_doc(pn, eval_fraction) for _, _, pn in pieces] if eval_fraction else [False]
        if eval_fraction:
            r = min((eval_rank(pn), p) for p, (_, _, pn) in enumerate(pieces))
            if lowest is None or r[0] < lowest[0]:
                lowest = (r[0], k, r[1])
        if all(f == flags[0] for f in flags):
            items["eval" if flags[0] else "train"].add(k, 0, n)
            where[k] = 1 if flags[0] else 0
        else:
            for (a, m, _), f in zip(pieces, flags):
                items["eval" if f else "train"].add(k, a, m)
            where[k] = 2
    info = {"pieces": pieces_total}
    if eval_fraction and not items["eval"].doc:
        if pieces_total < 2:
            log(f"  eval split: empty. --eval-fraction {eval_fraction} asks for held-out text, but the corpus is "
                f"one piece of at most {seq_len} tokens after dedup, which training needs; add documents or pass "
                f"--eval-fraction 0.")
            info["eval_empty"] = "one piece only"
        else:  # the hash put nothing in it: hold out the piece with the lowest hash
            _, k, p = lowest
            items = _move_to_eval(items, k, p, corpus, kept, lengths, seq_len)
            where[k] = 1 if lengths[k] <= seq_len else 2
            log(f"  eval split: no document or piece hashed into it at --eval-fraction {eval_fraction}; held out "
                f"the one with the lowest hash ({names[k]}{'' if lengths[k] <= seq_len else f', piece {p}'}).")
            info["eval_fallback"] = names[k]
    return items, where, info


def _move_to_eval(items, k, p, corpus, kept, lengths, seq_len):
    n = int(lengths[k])
    if n <= seq_len:
        piece = (0, n)
    else:
        cuts = split_points(n, seq_len, corpus.get("breaks", int(kept[k])).astype(np.int64),
                            corpus.get("strong", int(kept[k])).astype(np.int64))
        piece = (cuts[p], cuts[p + 1] - cuts[p])
    train = Items()
    for d, s, m in zip(items["train"].doc, items["train"].start, items["train"].length):
        if d != k:
            train.add(d, s, m)
            continue
        # document k was one train item: keep what is not the held-out piece
        if piece[0] > s:
            train.add(d, s, piece[0] - s)
        if piece[0] + piece[1] < s + m:
            train.add(d, piece[0] + piece[1], s + m - piece[0] - piece[1])
    ev = Items()
    ev.add(k, *piece)
    return {"train": train, "eval": ev}


# ----------------------------------------------------------------------------------------------
# pack and write, a group at a time


def groups(item_doc: np.ndarray, item_len: np.ndarray, clusters: np.ndarray | None, group_tokens: int):
    """Index arrays of items, each group about `group_tokens` tokens: whole clusters in cluster
    order (datasculpt), else runs of items in document order."""
    if clusters is None:
        order = np.arange(len(item_doc))
        keys = order
    else:
        c = clusters[item_doc]
        order = np.lexsort((np.arange(len(item_doc)), c))
        keys = c[order]
    cur, tokens = [], 0
    bounds = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    for a, b in zip(bounds.tolist(), np.r_[bounds[1:], len(keys)].tolist()):
        for run in _runs(order[a:b], item_len, group_tokens):  # a cluster bigger than a group: in runs
            cur.append(run)
            tokens += int(item_len[run].sum())
            if tokens >= group_tokens:
                yield np.concatenate(cur)
                cur, tokens = [], 0
    if cur:
        yield np.concatenate(cur)


def _runs(idx: np.ndarray, item_len: np.ndarray, group_tokens: int):
    """`idx` cut, in order, into runs of at most about `group_tokens` tokens (one run if it fits)."""
    ends = np.cumsum(item_len[idx])
    if len(ends) == 0 or ends[-1] <= group_tokens:
        yield idx
        return
    cuts = np.searchsorted(ends, np.arange(group_tokens, ends[-1], group_tokens), side="right")
    yield from (r for r in np.split(idx, np.unique(cuts)) if len(r))


class SplitWriter:
    """A split's tokens, segments and sample pointer, appended group by group."""

    def __init__(self, part: Path, split: str, seq_len: int, dtype, pad_id: int):
        self.part, self.split, self.seq_len, self.pad = part, split, seq_len, pad_id
        self.tokens = spill.NpyAppender(part / f"{split}.tokens.npy", dtype, (seq_len,))
        self.segments = spill.NpyAppender(part / f"{split}.segments.npy", np.int64, (5,))
        self.pointer = [0]
        self.samples = 0
        self.stats = {"tokens": 0, "docs": 0, "split_docs": 0, "pairs": 0, "hom_sum": 0.0, "hom_n": 0}

    def write(self, p: Packing, doc_of: np.ndarray, start_of: np.ndarray, corpus: Corpus, kept: np.ndarray,
              doc_base: int, emb_rows: np.ndarray | None) -> None:
        """A group's packing `p` over items; `doc_of`/`start_of` map an item to its kept document and offset."""
        seg = p.segments
        docs = doc_of[seg[:, DOC]]
        starts = start_of[seg[:, DOC]] + seg[:, START]
        order = np.lexsort((starts, docs, seg[:, SAMPLE]))  # within a sample: by document, then position
        seg, docs, starts = seg[order], docs[order], starts[order]
        counts = np.bincount(seg[:, SAMPLE], minlength=p.num_samples)
        ptr = np.cumsum(counts)
        cum = np.cumsum(seg[:, LENGTH]) - seg[:, LENGTH]
        first = np.r_[0, ptr[:-1]]
        offset = cum - cum[first[seg[:, SAMPLE]]]
        rows = np.full((p.num_samples, self.seq_len), self.pad, dtype=self.tokens.dtype)
        for w, d, s, n, off in zip(seg[:, SAMPLE].tolist(), docs.tolist(), starts.tolist(), seg[:, LENGTH].tolist(),
                                   offset.tolist()):
            rows[w, off:off + n] = corpus.get("tokens", int(kept[d]), s, s + n)
        self.tokens.append(rows)
        out = np.stack([seg[:, SAMPLE] + self.samples, offset, seg[:, LENGTH], doc_base + docs, starts], axis=1)
        self.segments.append(out)
        self.pointer.extend((self.pointer[-1] + ptr).tolist())
        self.samples += p.num_samples
        # quality figures, summed over groups
        s = self.stats
        s["tokens"] += int(seg[:, LENGTH].sum())
        pairs = np.unique(np.stack([docs, seg[:, SAMPLE]], 1), axis=0)
        udocs, per_doc = np.unique(pairs[:, 0], return_counts=True)
        s["docs"] += len(udocs)
        s["split_docs"] += int((per_doc > 1).sum())
        s["pairs"] += len(pairs)
        if emb_rows is not None and len(pairs):
            local = np.searchsorted(udocs, pairs[:, 0])
            vectors = np.stack([emb_rows[int(d)] for d in udocs.tolist()]).astype(np.float64)
            h = homogeneity(np.stack([local, pairs[:, 1]], 1), vectors, p.num_samples)
            if h["homogeneity"] is not None:
                s["hom_sum"] += h["homogeneity"] * h["multi_doc_samples"]
                s["hom_n"] += h["multi_doc_samples"]

    def close(self) -> dict:
        self.tokens.close()
        self.segments.close()
        np.save(self.part / f"{self.split}.{st.POINTER}.npy", np.asarray(self.pointer, dtype=np.int64))
        s = self.stats
        stats = {
            "samples": self.samples, "tokens": s["tokens"],
            "fill_rate": s["tokens"] / (self.samples * self.seq_len) if self.samples else 0.0,
            "split_fraction": s["split_docs"] / s["docs"] if s["docs"] else 0.0,
            "docs_per_sample": s["pairs"] / self.samples if self.samples else 0.0,
        }
        if s["hom_n"] or s["pairs"]:
            stats["homogeneity"] = s["hom_sum"] / s["hom_n"] if s["hom_n"] else None
            stats["multi_doc_samples"] = s["hom_n"]
        return stats


def pack_split(writer: SplitWriter, items: Items, strategy: str, seq_len: int, corpus: Corpus, kept: np.ndarray,
               clusters: np.ndarray | None, emb: Embeddings | None, group_tokens: int, doc_base: int,
               progress=None) -> int:
    """Pack and write one split, group by group; returns the number of groups."""
    item_doc, item_start, item_len = items.arrays()
    n_groups = 0
    for g in groups(item_doc, item_len, clusters if strategy == "datasculpt" else None, group_tokens):
        g = np.sort(g)  # items in document order inside a group, as a global packing sees them
        docs = item_doc[g]
        udocs = np.unique(docs)
        rows = emb.rows(udocs) if emb is not None else None
        emb_map = dict(zip(udocs.tolist(), rows)) if rows is not None else None
        item_emb = np.stack([emb_map[int(d)] for d in docs.tolist()]) if rows is not None else None
        breaks = strong = None
        if strategy != "concat":
            breaks, strong = [], []
            for d, s, n in zip(docs.tolist(), item_start[g].tolist(), item_len[g].tolist()):
                if n <= seq_len:
                    breaks.append(None)
                    strong.append(None)
                    continue
                for lst, what in ((breaks, "breaks"), (strong, "strong")):
                    b = corpus.get(what, int(kept[d])).astype(np.int64)
                    b = b[(b > s) & (b < s + n)] - s
                    lst.append(b)
        p = pack(strategy, item_len[g], seq_len, item_emb, None if clusters is None else clusters[docs],
                 breaks, strong)
        writer.write(p, docs, item_start[g], corpus, kept, doc_base, emb_map)
        n_groups += 1
        if progress is not None:
            progress.update(int(item_len[g].sum()))
    return n_groups


MISSING = "_missing"  # a stage record's key for why some of its figures are None (see timed)


def timed(records: dict, name: str, raw_bytes: int, log, fn, *args, **kwargs):
    t0 = time.perf_counter()
    result, rec = fn(*args, **kwargs)
    dt = time.perf_counter() - t0
    rec = dict(rec)
    # why a figure is missing ({key: words}): for the log line only; the record keeps the null
    missing = rec.pop(MISSING, {})
    rec["seconds"] = round(dt, 3)
    rec["mb_per_s"] = round(raw_bytes / 1e6 / dt, 2) if dt > 0 and raw_bytes else None
    records[name] = rec
    # a figure that does not exist (None) is said in words, or left out: never printed as "None"
    counts = ", ".join(f"{k} {v}" if v is not None else f"{k} n/a ({missing[k]})"
                       for k, v in rec.items()
                       if k not in ("seconds", "mb_per_s") and (v is not None or k in missing))
    log(f"  {name:<9} {dt:6.2f}s" + (f"  {rec['mb_per_s']:8.1f} MB/s" if rec["mb_per_s"] else "")
        + (f"  {counts}" if counts else ""))
    return result


def write_doc_files(part: Path, corpus: Corpus, kept: np.ndarray, names: list[str], lengths: np.ndarray,
                    where: np.ndarray, minhash: bool) -> None:
    labels = ("train", "eval", "both")
    with open(part / "docs.jsonl", "w") as f:
        for name, n, w in zip(names, lengths.tolist(), where.tolist()):
            f.write(json.dumps({"name": name, "tokens": n, "split": labels[w]}) + "\n")
    hashes = spill.NpyAppender(part / "hashes.npy", np.uint64)
    sigs = spill.NpyAppender(part / "minhash.npy", np.uint64, (128,)) if minhash else None
    for s, sh in enumerate(corpus.shards):
        lo, hi = corpus.starts[s], corpus.starts[s + 1]
        mine = kept[(kept >= lo) & (kept < hi)] - lo
        if len(mine) == 0:
            continue
        hashes.append(sh.hashes()[mine])
        if sigs is not None:
            sigs.append(np.asarray(sh.sigs()[mine], dtype=np.uint64))
    hashes.close()
    if sigs is not None:
        sigs.close()


def check_not_empty(kept: np.ndarray) -> None:
    if len(kept) == 0:
        raise DataError("every document is a duplicate of one already in the store; nothing to add.")

