"""In-memory document embeddings and clusters for the packing-quality benchmark
(benchmarks/data_pipeline.py --quality), which packs a whole corpus held in memory.

`embed_tfidf`: hashed word uni- and bigrams (scikit-learn's `HashingVectorizer`, 2^16 buckets),
sublinear TF-IDF, reduced to `dim` dimensions with a randomised truncated SVD (latent semantic
analysis) and normalised to unit length. Only the first `max_chars` characters of a document are
read: a document's head (imports, docstring, title) says what it is about. It needs scikit-learn
(the `bench` extra); the data build embeds with its own streaming features and exact SVD
(data/builder/embed.py) and does not use it.

`cluster`: the data build's own clustering (data/builder/cluster.py: spherical k-means, near
clusters merged) over an in-memory array, so the benchmark packs with the clusters a build makes.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from longctx.data.builder.cluster import cluster as build_cluster
from longctx.data.builder.embed import MAX_CHARS, unit_rows
from longctx.data.builder.parallel import parallel_map

DIM = 128


class InMemoryRows:
    """Rows of an array with the reading interface the build's k-means takes (embed.Embeddings')."""

    def __init__(self, vectors: np.ndarray):
        self.vectors = np.asarray(vectors, dtype=np.float32)
        self.n, self.dim = self.vectors.shape

    def rows(self, ids) -> np.ndarray:
        return self.vectors[np.asarray(ids, dtype=np.int64)]

    def chunks(self, size: int):
        for a in range(0, self.n, size):
            yield a, self.vectors[a:a + size]


def cluster(emb: np.ndarray, lengths: np.ndarray, seq_len: int, k: int = 0, seed: int = 0) -> np.ndarray:
    """Each document's cluster, as a data build with `--clusters k` (0: automatic) would make them."""
    if len(emb) == 0:
        return np.zeros(0, dtype=np.int64)
    labels, _ = build_cluster(InMemoryRows(emb), np.asarray(lengths), seq_len, k, seed)
    return labels


def _need_sklearn() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ImportError("the in-memory reference embeddings need scikit-learn: pip install -e '.[bench]' "
                          "(the data build does not use it)") from None


def _hash_features(texts: list[str]):
    # scikit-learn is optional (the `bench` extra): imported where it is used, as in embed_tfidf
    from sklearn.feature_extraction.text import HashingVectorizer

    hv = HashingVectorizer(n_features=2**16, alternate_sign=False, norm=None, ngram_range=(1, 2),
                           token_pattern=r"(?u)\b\w\w+\b", dtype=np.float32)
    return hv.transform(texts)


def embed_tfidf(texts: list[str], dim: int = DIM, workers: int = 1, seed: int = 0,
                max_chars: int = MAX_CHARS) -> np.ndarray:
    """Unit vectors [len(texts), dim] of the texts' heads."""
    _need_sklearn()
    # scikit-learn is an optional dependency (the `bench` extra): imported once it is known to be there
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer

    n = len(texts)
    if n == 0:
        return np.zeros((0, dim), dtype=np.float32)
    heads = [t[:max_chars] for t in texts]
    step = max(1, -(-n // max(1, workers)))
    parts = parallel_map(_hash_features, [heads[i:i + step] for i in range(0, n, step)], workers, chunksize=1)
    x = TfidfTransformer(sublinear_tf=True).fit_transform(sp.vstack(parts).tocsr())
    k = min(dim, n - 1, x.shape[1] - 1)
    if k >= 1 and x.nnz:
        z = TruncatedSVD(k, n_iter=3, random_state=seed).fit_transform(x)
    else:  # one document (or no words at all): nothing to compare
        z = np.ones((n, 1))
    out = np.zeros((n, dim), dtype=np.float32)
    out[:, :z.shape[1]] = z
    return unit_rows(out)
