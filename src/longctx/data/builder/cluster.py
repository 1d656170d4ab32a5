"""Semantic clusters of the kept documents: spherical k-means on the embeddings, near clusters merged.

The number of clusters defaults to one per ~8 samples of tokens (and at most one per 4
documents): enough clusters that a cluster holds related documents, few enough that each cluster
fills many samples, so its last, partly filled sample matters little. k-means is spherical
(cosine; the embeddings are unit vectors), Lloyd's iterations over chunks of rows, so its memory
is the centroids plus one chunk whatever the corpus; it reads rows through any object with `n`,
`dim`, `rows(ids)` and `chunks(size)` (embed.Embeddings, a file). Then clusters whose centroids
have cosine >= `MERGE_COSINE` are merged (union-find), since splitting one topic over two
clusters would only cost packing freedom.
"""

from __future__ import annotations

import numpy as np

from ...progress import current

SAMPLES_PER_CLUSTER = 8
DOCS_PER_CLUSTER = 4
MERGE_COSINE = 0.9


def default_k(num_docs: int, total_tokens: int, seq_len: int) -> int:
    k = min(total_tokens // (SAMPLES_PER_CLUSTER * seq_len), num_docs // DOCS_PER_CLUSTER, 4096)
    return max(1, int(k))


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


def kmeans(emb, k: int, seed: int, memory: int, iters: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (cosine; the embeddings are unit vectors), Lloyd's iterations over chunks
    of rows: memory is the centroids plus one chunk's similarities, whatever the corpus. Returns the
    labels and each cluster's sum of rows under them (the last iteration's, so no further pass)."""
    rng = np.random.default_rng(seed)
    cent = emb.rows(np.sort(rng.choice(emb.n, size=k, replace=False)))
    chunk = int(np.clip(memory // 16 // (k * 4), 64, 8192))
    labels = np.full(emb.n, -1, dtype=np.int64)
    progress = current()  # the cluster stage's phase (timing.py): iterations (it may stop sooner)
    progress.expect(iters, "k-means iterations")
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
        progress.update(1)
        if changed <= emb.n // 1000:
            break
    return labels, sums


def cluster(emb, lengths: np.ndarray, seq_len: int, k: int, seed: int,
            memory: int = 2 << 30) -> tuple[np.ndarray, dict]:
    """Each document's cluster (0..c-1, after merging) and the stage's record; `k` = 0: default_k."""
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
