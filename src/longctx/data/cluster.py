"""Semantic clusters of documents: k-means on the embeddings, then near clusters merged.

The number of clusters defaults to one per ~8 samples of tokens (and at most one per 4
documents): enough clusters that a cluster holds related documents, few enough that each cluster
fills many samples, so its last, partly filled sample matters little. k-means (scikit-learn,
k-means++ seeding, seeded) over unit vectors; then clusters whose centroids have cosine >=
`merge_cosine` are merged (union-find), since splitting one topic over two clusters would only
cost packing freedom.

`cluster` and `kmeans` are the in-memory reference the packing-quality benchmark uses
(benchmarks/data_pipeline.py --quality; scikit-learn, the `bench` extra). The data build clusters
with its own chunked spherical k-means (data/assemble.py) and uses only `default_k` and
`merge_centroids` from here.
"""

from __future__ import annotations

import numpy as np

SAMPLES_PER_CLUSTER = 8
DOCS_PER_CLUSTER = 4
MERGE_COSINE = 0.9


def default_k(num_docs: int, total_tokens: int, seq_len: int) -> int:
    k = min(total_tokens // (SAMPLES_PER_CLUSTER * seq_len), num_docs // DOCS_PER_CLUSTER, 4096)
    return max(1, int(k))


def _need_sklearn() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ImportError("the in-memory reference k-means needs scikit-learn: pip install -e '.[bench]' "
                          "(the data build does not use it)") from None


def kmeans(emb: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    n = len(emb)
    if k <= 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    k = min(k, n)
    _need_sklearn()
    if n > 20000:
        from sklearn.cluster import MiniBatchKMeans

        km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=1, batch_size=4096)
    else:
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=k, random_state=seed, n_init=1)
    return km.fit_predict(emb).astype(np.int64)


def merge_centroids(sums: np.ndarray, merge_cosine: float = MERGE_COSINE) -> np.ndarray:
    """Dense new labels 0..k'-1 for clusters with centroid (or centroid sum) rows `sums`: clusters
    whose centroids have cosine >= `merge_cosine` are united (union-find)."""
    cent = np.asarray(sums, dtype=np.float64)
    cent = cent / np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
    parent = list(range(len(cent)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for lo in range(0, len(cent), 512):  # blocks of rows: thousands of clusters never need a k x k matrix
        sim = cent[lo:lo + 512] @ cent.T
        for i, j in zip(*np.nonzero(sim >= merge_cosine)):
            i = int(i) + lo
            if int(j) > i:
                a, b = find(i), find(int(j))
                if a != b:
                    parent[max(a, b)] = min(a, b)
    root = np.array([find(i) for i in range(len(cent))])
    return np.unique(root, return_inverse=True)[1].astype(np.int64)


def merge_near(emb: np.ndarray, labels: np.ndarray, merge_cosine: float = MERGE_COSINE) -> np.ndarray:
    """Union clusters whose (unit) centroids are at least `merge_cosine` apart; relabel 0..k-1."""
    ids, inverse = np.unique(labels, return_inverse=True)
    cent = np.stack([emb[labels == c].mean(0) for c in ids])
    return merge_centroids(cent, merge_cosine)[inverse]


def cluster(emb: np.ndarray, lengths: np.ndarray, seq_len: int, k: int = 0, seed: int = 0,
            merge_cosine: float = MERGE_COSINE) -> np.ndarray:
    k = k or default_k(len(emb), int(np.sum(lengths)), seq_len)
    labels = kmeans(emb, k, seed)
    return merge_near(emb, labels, merge_cosine) if len(labels) else labels
