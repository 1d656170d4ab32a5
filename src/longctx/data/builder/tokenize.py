"""Batched, parallel tokenisation of documents, with the natural cut points packing needs.

Each document becomes the tokenizer's own prefix (`text_prefix`: Llama's BOS; none for the byte
tokenizer and many others), its tokens and one EOS (the document's `length` counts all three), plus two
sorted arrays of token offsets where the document could be cut if it is longer than a sample:
`breaks` (a token that starts a new line) and `strong` (a new line after a blank line: a new
paragraph, or a new top-level definition in source code). The byte tokenizer finds them from the
bytes directly; Hugging Face tokenizers from the encodings' character offsets. Hugging Face
tokenizers run their own thread pool over each batch (RAYON_NUM_THREADS = workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

NEWLINE = 10


@dataclass
class Tokenized:
    tokens: list[np.ndarray]  # per document, prefix and EOS included
    breaks: list[np.ndarray]
    strong: list[np.ndarray]

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(t) for t in self.tokens), dtype=np.int64, count=len(self.tokens))


def _byte_breaks(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nl = ids == NEWLINE
    breaks = np.flatnonzero(nl[:-1]) + 1
    strong = np.flatnonzero(nl[1:-1] & nl[:-2]) + 2
    return breaks, strong


def _offset_breaks(text: str, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token i starts a new line when a newline lies between token i-1's start and token i's start."""
    if len(starts) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    cum = np.concatenate([[0], np.cumsum(chars == NEWLINE)])  # newlines before char position
    before = cum[np.clip(starts, 0, len(chars))]
    step = np.diff(before)
    breaks = np.flatnonzero(step >= 1) + 1
    strong = np.flatnonzero(step >= 2) + 1
    return breaks, strong


def tokenize_one(text: str, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix + tokens + EOS, breaks, strong) of one document."""
    return next(iter(_tokenized([text], tok)))


def _tokenized(texts: list[str], tok):
    """(prefix + tokens + EOS, breaks, strong) per text, in order; the cut points count the prefix."""
    eos = np.array([tok.eos_id], dtype=np.int32)
    if getattr(tok, "name", "") == "byte":
        for text in texts:
            ids = tok.encode(text)
            yield (np.concatenate([ids, eos]), *_byte_breaks(ids))
        return
    prefix = np.asarray(tok.text_prefix(), dtype=np.int32)
    for text, enc in zip(texts, tok.encode_encodings(texts)):
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        breaks, strong = _offset_breaks(text, starts)
        yield (np.concatenate([prefix, ids, eos]), breaks + len(prefix), strong + len(prefix))


def tokenize(texts: list[str], tok, workers: int = 1, batch: int = 256, progress=None) -> Tokenized:
    if getattr(tok, "name", "") != "byte":
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, workers)))
    tokens, breaks, strong = [], [], []
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        for t, b, s in _tokenized(chunk, tok):
            tokens.append(t)
            breaks.append(b)
            strong.append(s)
        if progress is not None:
            progress.update(len(chunk))
    return Tokenized(tokens, breaks, strong)
