"""Exact and near-duplicate removal.

- exact: a 64-bit hash (blake2b) of the text with its line ends made LF and each line's trailing
  whitespace (and trailing blank lines) dropped, so a copy that differs only in those is still an
  exact duplicate; indentation and spacing within a line count (code that differs only in its
  indentation is another program).
- near (MinHash LSH): 128-permutation MinHash signatures (datasketch's form and permutations) of
  the set of 5-grams of words: whitespace-separated, except that each character of a script written
  without spaces (CJK ideographs, kana, Thai, Lao, Khmer, Myanmar, and their punctuation) is a word
  of its own; a document of fewer than 5 words is one shingle of all of them, in order (so "dog
  bites man" is not "man bites dog"); candidates share a band of the signature in a
  numpy index (`_KeyIndex`, banded for a threshold 0.2 below the Jaccard threshold, default 0.8,
  so that pairs near it are not missed) and
  are confirmed by the true Jaccard similarity of the two shingle sets >= the threshold, computed
  for candidates only. (The signature estimate's error is about +/-0.04 at 128 permutations: a
  3,128-character file with 5 characters changed, true Jaccard 0.868, was estimated at 0.781 and
  kept.) A candidate from an earlier part of the store, whose text is not at hand, is confirmed by
  the estimate. How often estimate and truth disagree is counted and reported. A few
  changed characters in a document of a few hundred words change only ~5 shingles per edit, so
  its similarity to the original stays well above the threshold.

Instruction data (a prompt and its answers: `Document.trained_chars`) are copies only of instruction data,
and only where both parts are: the exact hash is of the pieces in order (the same text cut at another
switch is another document), the signature of the answers, and a candidate is confirmed by both the
answers' and the prompts' Jaccard >= the threshold (many questions on one long document share the prompt
that a signature of the whole would be made of; one short answer, "4", follows many prompts). A
candidate of an earlier part of the store is not confirmed for instruction data (no prompt's signature is
kept): only its exact copies are found there.

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

from .parallel import parallel_map
from .scripts import HAS_UNSPACED, UNSPACED

# of the exact hash and the shingles: 2 keeps indentation, shingles short and CJK / Thai text; 3 hashes instruction
# data by its pieces and signs its answers
VERSION = 3
NUM_PERM = 128
SHINGLE = 5
_PRIME = np.uint64((1 << 61) - 1)
_MAX32 = np.uint64(0xFFFFFFFF)
_TRAILING = re.compile(r"[^\S\n]+$", re.MULTILINE)  # whitespace at the end of a line, but the newline
_WORD = re.compile(f"[{UNSPACED}]|[^\\s{UNSPACED}]+")  # (scripts.py: each unspaced character a word)


def exact_hash(text: str) -> int:
    norm = text.replace("\r\n", "\n").replace("\r", "\n")
    norm = _TRAILING.sub("", norm).rstrip("\n").encode("utf-8")
    return int.from_bytes(hashlib.blake2b(norm, digest_size=8).digest(), "little")


def instruction_pieces(text: str, switches) -> list[str]:
    """Instruction data cut where its training starts and stops (Document.trained_chars): prompt, answer,
    turns between, answer, ..."""
    cuts = [0, *switches, len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def instruction_hash(text: str, switches) -> int:
    """The exact hash of instruction data: of its pieces' hashes in order."""
    digest = hashlib.blake2b(b"instruction", digest_size=8)
    for piece in instruction_pieces(text, switches):
        digest.update(exact_hash(piece).to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little")


def instruction_parts(text: str, switches) -> tuple[str, str]:
    """(what is read: the prompt and the turns between answers, what is trained on: the answers), each
    piece on a line of its own (no word of one runs into the next's)."""
    pieces = instruction_pieces(text, switches)
    return "\n".join(pieces[0::2]), "\n".join(pieces[1::2])


def words_of(text: str) -> list[str]:
    """The words shingles are made of (whitespace-separated; a CJK / Thai / ... character alone)."""
    if text.isascii() or not HAS_UNSPACED.search(text):
        return text.split()
    return _WORD.findall(text)


def _permutations(num_perm: int = NUM_PERM, seed: int = 1):
    rng = np.random.RandomState(seed)  # the same generator datasketch uses for its permutations
    a = rng.randint(1, int(_PRIME), size=num_perm, dtype=np.uint64)
    b = rng.randint(0, int(_PRIME), size=num_perm, dtype=np.uint64)
    return a, b


_A, _B = _permutations()


def shingle_hashes(text: str) -> np.ndarray:
    """Sorted unique 32-bit hashes of the text's shingles: its runs of SHINGLE words, or all its words
    as one shingle when it has fewer."""
    words = words_of(text)
    h = np.fromiter((zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in words), dtype=np.uint64, count=len(words))
    if len(h):
        k_words = min(SHINGLE, len(h))
        acc = np.zeros(len(h) - k_words + 1, dtype=np.uint64)
        for k in range(k_words):
            acc = acc * np.uint64(1000003) + h[k:len(h) - k_words + 1 + k]
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
    sigs = parallel_map(signature, texts, workers)
    return np.stack(sigs) if sigs else np.zeros((0, NUM_PERM), dtype=np.uint64)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique shingle-hash arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed trapz


def band_params(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band) with bands x rows <= num_perm that minimise the mean of the false
    positive and false negative probability mass around `threshold` (the choice MinHash LSH
    libraries make): a pair of Jaccard s shares a band with probability 1 - (1 - s^r)^b."""
    s = np.linspace(0.0, 1.0, 2001)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1 - (1 - s ** r) ** b
            lo, hi = s <= threshold, s >= threshold
            err = 0.5 * _trapezoid(p[lo], s[lo]) + 0.5 * _trapezoid(1 - p[hi], s[hi])
            if err < best_err:
                best, best_err = (b, r), err
    return best


class _KeyIndex:
    """uint64 key -> ids, memory-lean: a sorted array plus a small dict of recent keys, merged
    into the array when the dict grows (12 bytes per entry instead of a Python dict's ~100)."""

    def __init__(self):
        self.keys = np.zeros(0, np.uint64)
        self.ids = np.zeros(0, np.int64)
        self.recent: dict[int, list[int]] = {}
        self.recent_entries = 0

    def add(self, keys, ident: int) -> None:
        for k in np.atleast_1d(keys).tolist():
            self.recent.setdefault(k, []).append(ident)
        self.recent_entries += np.size(keys)
        if self.recent_entries > max(65536, len(self.keys) // 4):
            self._merge()

    def _merge(self) -> None:
        ks = np.fromiter((k for k, v in self.recent.items() for _ in v), np.uint64, self.recent_entries)
        vs = np.fromiter((i for v in self.recent.values() for i in v), np.int64, self.recent_entries)
        keys, ids = np.concatenate([self.keys, ks]), np.concatenate([self.ids, vs])
        order = np.argsort(keys, kind="stable")
        self.keys, self.ids = keys[order], ids[order]
        self.recent, self.recent_entries = {}, 0

    def find(self, keys) -> list[int]:
        """Ids stored under any of `keys`, in insertion order within a key."""
        keys = np.atleast_1d(np.asarray(keys, np.uint64))
        out: list[int] = []
        lo = np.searchsorted(self.keys, keys, side="left")
        hi = np.searchsorted(self.keys, keys, side="right")
        for a, b in zip(lo.tolist(), hi.tolist()):
            out.extend(self.ids[a:b].tolist())
        for k in keys.tolist():
            out.extend(self.recent.get(k, ()))
        return out

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.ids.nbytes + 120 * self.recent_entries


_BAND_MUL = np.uint64(0x100000001B3)


class Deduper:
    """Streaming dedup in input order: `check` one document at a time; the first occurrence is kept.

    Exact duplicates by their hash; near duplicates by MinHash LSH candidates (banded for a
    threshold 0.2 below the Jaccard threshold, so that pairs near it are found almost surely),
    each confirmed by the true Jaccard of the two shingle sets (`text_of(id)` gives a kept
    document's text back). Candidates from earlier parts of a store (`seed`), whose text is not
    at hand, are confirmed by the signature estimate. Memory: 8 bytes per document for exact
    hashes and 12 per band per kept document for the LSH index."""

    def __init__(self, mode: str, threshold: float = 0.8, text_of=None, sig_of=None, switches_of=None):
        self.mode, self.threshold, self.text_of, self.sig_of = mode, threshold, text_of, sig_of
        self.switches_of = switches_of  # a document's trained_chars (empty: a plain document); None: all plain
        self.hashes = _KeyIndex()
        self.bands, self.rows = band_params(max(0.05, threshold - 0.2))
        self.lsh = _KeyIndex()
        self.old_sigs: np.ndarray | None = None
        self.exact = self.near = self.checked = self.disagreed = 0
        self._shingles: dict[int, np.ndarray] = {}

    def _band_keys(self, sig: np.ndarray) -> np.ndarray:
        b = np.asarray(sig[:self.bands * self.rows], np.uint64).reshape(self.bands, self.rows)
        key = np.arange(self.bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for j in range(self.rows):
            key = key * _BAND_MUL + b[:, j]
        return key

    def seed(self, hashes: np.ndarray, sigs: np.ndarray | None, plain: np.ndarray | None = None) -> None:
        """Documents of earlier parts of the store (ids -1, -2, ...); near copies are looked for among
        the `plain` ones of `sigs` only (None: all; instruction data's are confirmed in-build only)."""
        for j, h in enumerate(np.asarray(hashes, np.uint64).tolist()):
            self.hashes.add(np.uint64(h), -1 - j)
        if sigs is not None and self.mode == "minhash":
            self.old_sigs = sigs
            for j, sig in enumerate(sigs):
                if plain is None or plain[j]:
                    self.lsh.add(self._band_keys(sig), -1 - j)

    def _texts(self, ident: int, text: str | None = None) -> tuple[str, ...]:
        """What a copy must be near: the text of a plain document; a prompt and its answers (instruction data)."""
        text = text if text is not None else self.text_of(ident)
        switches = self.switches_of(ident) if self.switches_of is not None else ()
        return instruction_parts(text, switches) if len(switches) else (text,)

    def _shingle_sets(self, ident: int, text: str | None = None) -> list[np.ndarray]:
        got = self._shingles.get(ident)
        if got is None:
            got = [shingle_hashes(t) for t in self._texts(ident, text)]
            if len(self._shingles) >= 256:  # a small cache: a document is often a candidate of its copies
                self._shingles.pop(next(iter(self._shingles)))
            self._shingles[ident] = got
        return got

    def _instruction(self, ident: int) -> bool:
        return self.switches_of is not None and len(self.switches_of(ident)) > 0

    def _similarity(self, ident: int, other: int, text: str | None) -> float:
        """The true Jaccard of two documents' shingle sets (of instruction data, the lower of its prompts'
        and its answers')."""
        return min(jaccard(a, b) for a, b in zip(self._shingle_sets(ident, text), self._shingle_sets(other)))

    def check(self, ident: int, h: int, sig: np.ndarray | None = None, text: str | None = None) -> str | None:
        """None (kept, and remembered), "exact" or "near" for document `ident`."""
        if self.mode == "none":
            return None
        if self.hashes.find(np.uint64(h)):
            self.exact += 1
            return "exact"
        self.hashes.add(np.uint64(h), ident)
        if self.mode != "minhash":
            return None
        keys = self._band_keys(sig)
        instruction = self._instruction(ident)
        for c in dict.fromkeys(self.lsh.find(keys)):
            if instruction if c < 0 else instruction != self._instruction(c):
                continue  # (a plain document and instruction data are never copies; an earlier part's: seeded plain)
            other = self.old_sigs[-1 - c] if c < 0 else self.sig_of(c)
            estimate = float(np.mean(np.asarray(other, np.uint64) == np.asarray(sig, np.uint64)))
            if c < 0:
                duplicate = estimate >= self.threshold
            else:
                truth = self._similarity(ident, c, text)
                self.checked += 1
                self.disagreed += (estimate >= self.threshold) != (truth >= self.threshold)
                duplicate = truth >= self.threshold
            if duplicate:
                self.near += 1
                self._shingles.pop(ident, None)
                return "near"
        self.lsh.add(keys, ident)
        return None


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
    """Which of `texts` to keep (a `Deduper` over documents in memory). `seen_*` are earlier parts
    of a store: duplicates of them go too."""
    n = len(texts)
    hashes = np.fromiter((exact_hash(t) for t in texts), dtype=np.uint64, count=n)
    sigs = signatures(texts, workers) if mode == "minhash" else None
    dd = Deduper(mode, threshold, text_of=lambda i: texts[i], sig_of=lambda i: sigs[i])
    if seen_hashes is not None:
        dd.seed(seen_hashes, seen_signatures)
    keep = np.array([dd.check(i, h, None if sigs is None else sigs[i]) is None
                     for i, h in enumerate(hashes.tolist())], dtype=bool)
    return DedupResult(keep, dd.exact, dd.near, hashes, sigs, dd.checked, dd.disagreed)
