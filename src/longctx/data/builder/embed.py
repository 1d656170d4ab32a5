"""Document embeddings of the build: unit vectors [documents, DIM] on disk, for clustering and relevance.

Default (no model download): TF-IDF of the hashed head features the scan left (features.py), with
the idf of every kept document, reduced to DIM dimensions by a truncated SVD fitted on an evenly
spaced sample of up to `FIT_DOCS` documents, then applied chunk by chunk: memory follows the
sample and one chunk, not the corpus. With `model=PATH`, a local sentence-transformers model embeds
the documents' text heads (their first `MAX_CHARS` characters) instead. The vectors are written
to a file (`emb.npy` in the work directory) and read back by rows (`Embeddings`). The documents
embedded are counted in the running progress phase (the embed stage's), as a model on a CPU may
take minutes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import DataError
from ...progress import current, phase
from . import spill
from .features import BUCKETS
from .scan import ScannedCorpus

FIT_DOCS = 2048
CHUNK = 2048
TRANSFORM_CHUNK = 256  # documents per sparse TF-IDF block (~3,000 features each)
DIM = 128
MAX_CHARS = 16384  # characters of a document's head a sentence-transformers model reads


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


def tfidf_rows(corpus: ScannedCorpus, docs: np.ndarray, idf: np.ndarray, col_of: np.ndarray | None = None):
    """Sublinear TF-IDF rows, L2-normalised (scikit-learn's TfidfTransformer defaults), as CSR over
    the feature buckets, or with `col_of` (bucket -> column, -1 = dropped) over those columns."""
    # imported here, not at the top: the main process stays without scipy while the scan runs
    # (options.py counts a quarter of MAIN_BYTES for it then)
    import scipy.sparse as sp

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


def unit_rows(z: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float32); an all-zero row (a document without words) becomes a
    fixed direction, not NaN."""
    z = z.astype(np.float32)
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    z = z / np.maximum(norms, 1e-12)
    z[norms[:, 0] == 0] = 0.0
    z[norms[:, 0] == 0, 0] = 1.0
    return z


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


def embed(corpus: ScannedCorpus, kept: np.ndarray, out: Path, model: str = "",
          memory: int = 2 << 30) -> tuple[Embeddings, dict]:
    """Embeddings of the kept documents, written to `out`."""
    writer = spill.NpyAppender(out, np.float32, (DIM,))
    progress = current()  # the embed stage's phase (timing.py)
    progress.expect(len(kept), "documents")
    record = (_embed_with_model if model else _embed_tfidf)(writer, corpus, kept, model or memory, progress)
    writer.close()
    return Embeddings(out), record


def _embed_with_model(writer: spill.NpyAppender, corpus: ScannedCorpus, kept: np.ndarray, model: str,
                      progress) -> dict:
    """A local sentence-transformers model over the text heads, chunk by chunk."""
    for a in range(0, len(kept), CHUNK):
        z = embed_model([corpus.text(d)[:MAX_CHARS] for d in kept[a:a + CHUNK].tolist()], model, progress)
        out_rows = np.zeros((len(z), DIM), np.float32)
        out_rows[:, :min(DIM, z.shape[1])] = z[:, :DIM]
        writer.append(unit_rows(out_rows))
    return {"dim": DIM, "model": model}


def _embed_tfidf(writer: spill.NpyAppender, corpus: ScannedCorpus, kept: np.ndarray, memory: int, progress) -> dict:
    """TF-IDF of the head features (idf over every kept document), reduced by a truncated SVD
    fitted on an evenly spaced sample, applied TRANSFORM_CHUNK documents at a time."""
    n = len(kept)
    df = np.zeros(BUCKETS, dtype=np.int64)
    for d in kept.tolist():
        df[corpus.get("feat_idx", d)] += 1
    idf = (np.log((1 + n) / (1 + df)) + 1.0).astype(np.float32)
    fit = kept[np.unique(np.linspace(0, n - 1, min(n, fit_documents(memory))).astype(np.int64))] if n else kept
    # only the features the sample has: the others get no weight in the components anyway
    cols = np.unique(np.concatenate([corpus.get("feat_idx", d) for d in fit.tolist()] or [np.zeros(0, np.uint16)]))
    col_of = np.full(BUCKETS, -1, dtype=np.int32)
    col_of[cols] = np.arange(len(cols), dtype=np.int32)
    with phase(f"SVD fit on {len(fit):,} documents", done_line=False):  # (one long numpy call: no count)
        x = tfidf_rows(corpus, fit, idf, col_of)
        k = min(DIM, len(fit) - 1, len(cols) - 1)
        comp = svd_components(x, k) if k >= 1 and x.nnz else None
    k = 0 if comp is None else comp.shape[0]
    del x
    for a in range(0, n, TRANSFORM_CHUNK):
        rows = tfidf_rows(corpus, kept[a:a + TRANSFORM_CHUNK], idf, col_of)
        z = np.zeros((rows.shape[0], DIM), np.float32)
        if k:
            z[:, :k] = rows @ comp.T
        else:
            z[:, 0] = 1.0
        writer.append(unit_rows(z))
        progress.update(rows.shape[0])
    return {"dim": DIM, "model": "hashed-tfidf-svd", "fit_documents": int(len(fit))}


ENCODE_BATCH = 32   # texts per forward of a sentence-transformers model
COUNT_EVERY = 256   # texts encoded between two counts of the progress phase


def embed_model(texts: list[str], model: str, progress=None) -> np.ndarray:
    """Unit vectors of `texts` from the local sentence-transformers model directory `model`; the
    texts encoded are counted in `progress` (a progress.Phase) as they go."""
    try:
        # an optional dependency, imported only when --embed-model asks for it
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise DataError(
            f"--embed-model {model} needs the sentence-transformers package, which is not installed; "
            f"pip install sentence-transformers, or leave --embed-model out to use the built-in TF-IDF embeddings."
        ) from None
    try:
        st = SentenceTransformer(model, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - many loader errors, one message
        raise DataError(f"could not load the local sentence-embedding model '{model}' ({e}); pass the directory "
                        f"of a downloaded sentence-transformers model.") from None
    parts = []
    for a in range(0, len(texts), COUNT_EVERY):
        batch = [t[:MAX_CHARS] for t in texts[a:a + COUNT_EVERY]]
        parts.append(np.asarray(st.encode(batch, batch_size=ENCODE_BATCH, show_progress_bar=False,
                                          convert_to_numpy=True), dtype=np.float32))
        if progress is not None:
            progress.update(len(batch))
    return unit_rows(np.concatenate(parts) if parts else np.zeros((0, DIM), np.float32))
