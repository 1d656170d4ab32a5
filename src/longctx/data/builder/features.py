"""Hashed word features of a document's head, computed where the document is read (a scan worker).

A document's head (its first `MAX_CHARS` characters, lower-cased) becomes counts of its words
(runs of 2+ word characters; in scripts written without spaces, scripts.py, each character) and
word bigrams (there: character bigrams, most of Chinese's words), hashed into `BUCKETS` buckets:
word hashes are CRC32, a bigram's hash combines its two word hashes. The scan workers keep these sparse counts
(a few thousand buckets per document) instead of the text, and the build's embed stage turns them
into TF-IDF vectors (idf over every kept document) reduced by a truncated SVD (embed.py).
Written here with numpy and zlib only, so that the workers stay small (scikit-learn's
HashingVectorizer would cost each worker ~150 MB of imports).
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from .scripts import HAS_UNSPACED, UNSPACED

MAX_CHARS = 16384
BUCKETS = 1 << 16
_WORD = re.compile(r"(?u)\b\w\w+\b")
# with unspaced scripts: each of their characters, or a run of 2+ other word characters
_MIXED_WORD = re.compile(f"[{UNSPACED}]|(?:(?![{UNSPACED}])\\w){{2,}}")


def head_features(text: str, max_chars: int = MAX_CHARS) -> tuple[np.ndarray, np.ndarray]:
    """(sorted bucket indices uint32, counts float32) of the head's words and word bigrams."""
    head = text[:max_chars].lower()
    words = (_MIXED_WORD if not head.isascii() and HAS_UNSPACED.search(head) else _WORD).findall(head)
    if not words:
        return np.zeros(0, np.uint32), np.zeros(0, np.float32)
    uniq, inverse = np.unique(np.asarray(words), return_inverse=True)
    h = np.fromiter((zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in uniq.tolist()),
                    dtype=np.uint64, count=len(uniq))[inverse]
    bigrams = (h[:-1] * np.uint64(1_000_003) + h[1:] + np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    buckets = np.concatenate([h, bigrams]) % np.uint64(BUCKETS)
    idx, counts = np.unique(buckets.astype(np.uint32), return_counts=True)
    return idx, counts.astype(np.float32)
