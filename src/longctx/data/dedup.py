"""Exact and near-duplicate removal.

- exact: a 64-bit hash (blake2b) of the text with runs of whitespace collapsed, so a copy that
  differs only in spacing or line ends is still an exact duplicate.
- near (MinHash LSH, via datasketch): 128-permutation MinHash signatures of the set of 5-grams of
  whitespace-separated words; candidates come from datasketch's `MinHashLSH` (banded for a
  threshold 0.2 below the Jaccard threshold, default 0.8, so that pairs near it are not missed) and
  are confirmed by the true Jaccard similarity of the two shingle sets >= the threshold, computed
  for candidates only. (The signature estimate's error is about +/-0.04 at 128 permutations: a
  3,128-character file with 5 characters changed, true Jaccard 0.868, was estimated at 0.781 and
  kept.) A candidate from an earlier part of the store, whose text is not at hand, is confirmed by
  the estimate. How often estimate and truth disagree is counted and reported. A few
  changed characters in a document of a few hundred words change only ~5 shingles per edit, so
  its similarity to the original stays well above the threshold.

The first occurrence (in input order) is kept. Signatures are computed in `workers` processes;
the shingle hashes are CRC32 of words combined with a rolling polynomial, vectorised in numpy
(datasketch's own per-shingle SHA-1 in Python is ~10x slower on source code).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

import numpy as np

NUM_PERM = 128
SHINGLE = 5
_PRIME = np.uint64((1 << 61) - 1)
_MAX32 = np.uint64(0xFFFFFFFF)
_WS = re.compile(r"\s+")


def exact_hash(text: str) -> int:
    norm = _WS.sub(" ", text).strip().encode("utf-8")
    return int.from_bytes(hashlib.blake2b(norm, digest_size=8).digest(), "little")


def _permutations(num_perm: int = NUM_PERM, seed: int = 1):
    rng = np.random.RandomState(seed)  # the same generator datasketch uses for its permutations
    a = rng.randint(1, int(_PRIME), size=num_perm, dtype=np.uint64)
    b = rng.randint(0, int(_PRIME), size=num_perm, dtype=np.uint64)
    return a, b


_A, _B = _permutations()


def shingle_hashes(text: str) -> np.ndarray:
    words = text.split()
    h = np.fromiter((zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in words), dtype=np.uint64, count=len(words))
    if len(h) >= SHINGLE:
        acc = np.zeros(len(h) - SHINGLE + 1, dtype=np.uint64)
        for k in range(SHINGLE):
            acc = acc * np.uint64(1000003) + h[k:len(h) - SHINGLE + 1 + k]
        h = acc & _MAX32
    return np.unique(h)


def signature(text: str) -> np.ndarray:
    """MinHash signature (uint64 values < 2^32), the same form datasketch's MinHash keeps."""
    sh = shingle_hashes(text)
    if len(sh) == 0:
        return np.full(NUM_PERM, _MAX32, dtype=np.uint64)
    out = np.full(NUM_PERM, _MAX32, dtype=np.uint64)
    for i in range(0, len(sh), 8192):  # bounded memory for very long documents
        block = sh[i:i + 8192, None]
        ph = ((block * _A[None, :] + _B[None, :]) % _PRIME) & _MAX32
        np.minimum(out, ph.min(axis=0), out=out)
    return out


def signatures(texts: list[str], workers: int = 1) -> np.ndarray:
    from .parallel import parallel_map

    sigs = parallel_map(signature, texts, workers)
    return np.stack(sigs) if sigs else np.zeros((0, NUM_PERM), dtype=np.uint64)


def _minhash(sig: np.ndarray):
    """A datasketch MinHash holding our signature (the permutation scheme datasketch calls 'legacy')."""
    from datasketch import MinHash

    try:
        return MinHash(num_perm=NUM_PERM, hashvalues=sig, scheme="legacy")
    except TypeError:  # datasketch < 2.0 has one scheme, this one
        return MinHash(num_perm=NUM_PERM, hashvalues=sig)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique shingle-hash arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


@dataclass
class DedupResult:
    keep: np.ndarray             # bool per input document
    exact_duplicates: int
    near_duplicates: int
    hashes: np.ndarray           # uint64 exact hash per input document
    signatures: np.ndarray | None  # uint64 [n, NUM_PERM] when near-duplicate detection ran
    candidates_checked: int = 0  # LSH candidate pairs whose true Jaccard was computed
    estimate_disagreed: int = 0  # of those, pairs the signature estimate put on the other side of the threshold


def deduplicate(texts: list[str], mode: str, threshold: float = 0.8, workers: int = 1,
                seen_hashes: np.ndarray | None = None, seen_signatures: np.ndarray | None = None) -> DedupResult:
    """Which documents to keep. `seen_*` are earlier parts of a store: duplicates of them go too."""
    n = len(texts)
    hashes = np.fromiter((exact_hash(t) for t in texts), dtype=np.uint64, count=n)
    keep = np.ones(n, dtype=bool)
    if mode == "none":
        return DedupResult(keep, 0, 0, hashes, None)
    seen = set(seen_hashes.tolist()) if seen_hashes is not None else set()
    for i, h in enumerate(hashes.tolist()):
        if h in seen:
            keep[i] = False
        else:
            seen.add(h)
    exact = int((~keep).sum())
    if mode == "exact":
        return DedupResult(keep, exact, 0, hashes, None)

    from datasketch import MinHashLSH

    sigs = signatures(texts, workers)
    # LSH bands tuned below the threshold: candidates near it are found almost surely, and the
    # signature estimate then decides (a band tuned at the threshold misses ~10% of pairs there)
    lsh = MinHashLSH(threshold=max(0.05, threshold - 0.2), num_perm=NUM_PERM)
    stored: dict[str, np.ndarray] = {}
    if seen_signatures is not None:
        for j, sig in enumerate(seen_signatures):
            key = f"old{j}"
            lsh.insert(key, _minhash(sig), check_duplication=False)
            stored[key] = sig
    near = checked = disagreed = 0
    shingles: dict[int, np.ndarray] = {}  # of this build's documents that were candidates (computed once)

    def shingle_set(j: int) -> np.ndarray:
        if j not in shingles:
            shingles[j] = shingle_hashes(texts[j])
        return shingles[j]

    for i in range(n):
        if not keep[i]:
            continue
        mh = _minhash(sigs[i])
        duplicate = False
        for c in lsh.query(mh):
            estimate = float(np.mean(stored[c] == sigs[i]))
            if c.startswith("old"):  # an earlier part: its text is not at hand
                duplicate = estimate >= threshold
            else:  # confirmed by the true Jaccard of the shingle sets
                truth = jaccard(shingle_set(i), shingle_set(int(c[3:])))
                checked += 1
                disagreed += (estimate >= threshold) != (truth >= threshold)
                duplicate = truth >= threshold
            if duplicate:
                break
        if duplicate:
            keep[i] = False
            near += 1
            continue
        key = f"new{i}"
        lsh.insert(key, mh, check_duplication=False)
        stored[key] = sigs[i]
    return DedupResult(keep, exact, near, hashes, sigs, checked, disagreed)
