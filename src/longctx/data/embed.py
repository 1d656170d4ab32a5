"""Document embeddings for clustering and relevance.

Default (no model download): hashed word uni- and bigrams (scikit-learn's `HashingVectorizer`,
2^16 buckets), sublinear TF-IDF, reduced to `dim` dimensions with a randomised truncated SVD
(latent semantic analysis) and normalised to unit length. Only the first `max_chars` characters
of a document are read: a document's head (imports, docstring, title) says what it is about, and
this bounds the cost on very long documents. The hashing step runs in `workers` processes.

With `model=PATH`, a local sentence-transformers model embeds the same text heads instead.

`embed_tfidf` is the in-memory reference the packing-quality benchmark uses (scikit-learn, the
`bench` extra). The data build embeds with its own streaming features and exact idf and SVD
(data/features.py, data/assemble.py) and uses only `embed_model` and `_unit` from here.
"""

from __future__ import annotations

import numpy as np

from ..errors import DataError

MAX_CHARS = 16384
DIM = 128


def _hash_features(texts: list[str]):
    from sklearn.feature_extraction.text import HashingVectorizer

    hv = HashingVectorizer(n_features=2**16, alternate_sign=False, norm=None, ngram_range=(1, 2),
                           token_pattern=r"(?u)\b\w\w+\b", dtype=np.float32)
    return hv.transform(texts)


def embed_tfidf(texts: list[str], dim: int = DIM, workers: int = 1, seed: int = 0,
                max_chars: int = MAX_CHARS) -> np.ndarray:
    from .cluster import _need_sklearn

    _need_sklearn()
    import scipy.sparse as sp
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer

    from .parallel import parallel_map

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
    return _unit(out)


def embed_model(texts: list[str], model: str, max_chars: int = MAX_CHARS) -> np.ndarray:
    try:
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
    z = st.encode([t[:max_chars] for t in texts], batch_size=32, show_progress_bar=False, convert_to_numpy=True)
    return _unit(np.asarray(z, dtype=np.float32))


def embed(texts: list[str], model: str = "", workers: int = 1, seed: int = 0) -> np.ndarray:
    return embed_model(texts, model) if model else embed_tfidf(texts, workers=workers, seed=seed)


def _unit(z: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    z = z / np.maximum(norms, 1e-12)
    z[norms[:, 0] == 0] = 0.0
    z[norms[:, 0] == 0, 0] = 1.0  # a document without words: a fixed direction, not NaN
    return z
