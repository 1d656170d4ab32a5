"""The files of a shard being scanned (scan.py scan_shard), written a document at a time: its text, tokens
(tokenize.py: a plain document, or instruction data with where its training starts and pauses), line and
paragraph breaks, head features, exact hash, MinHash signature and name, each appended as the document
is read (spill.py), so a shard's memory does not grow with its documents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import spill
from .dedup import NUM_PERM, exact_hash, instruction_hash, instruction_parts, signature
from .features import head_features
from .tokenize import tokenize_answers, tokenize_one


class ShardFiles:
    """The files of a shard being scanned, a document at a time; `mark` and `rollback` drop the
    documents of a unit found damaged after it yielded them (readers.py)."""

    def __init__(self, tmp: Path, token_dtype: str, minhash: bool):
        self.ragged = {what: spill.RaggedWriter(tmp / what, dtype) for what, dtype in (
            ("text", np.uint8), ("tokens", token_dtype), ("breaks", np.int32), ("strong", np.int32),
            ("feat_idx", np.uint16), ("feat_val", np.float32), ("gaps", np.int64), ("chars", np.int64))}
        self.hashes = spill.NpyAppender(tmp / "hashes.npy", np.uint64)
        self.loss_from = spill.NpyAppender(tmp / "loss_from.npy", np.int64)  # 0: a plain document
        self.sigs = spill.NpyAppender(tmp / "sigs.npy", np.uint32, (NUM_PERM,)) if minhash else None
        self.names = open(tmp / "names.jsonl", "w")
        self.n = self.raw = 0

    def _writers(self) -> list:
        return [*self.ragged.values(), self.hashes, self.loss_from] + ([self.sigs] if self.sigs is not None else [])

    def add(self, doc, tok) -> None:
        b = doc.text.encode("utf-8", "surrogatepass")
        self.ragged["text"].append(b)
        self.raw += len(b)
        switches = doc.trained_chars or ()
        # instruction data: hashed by its pieces, its signature of the answers (dedup.py says why)
        h = instruction_hash(doc.text, switches) if switches else exact_hash(doc.text)
        self.hashes.append(np.array([h], np.uint64))
        if self.sigs is not None:
            text = instruction_parts(doc.text, switches)[1] if switches else doc.text
            self.sigs.append(signature(text)[None].astype(np.uint32))
        self.ragged["chars"].append(np.asarray(switches, np.int64))
        if doc.trained_chars is None:
            tokenized, switches = tokenize_one(doc.text, tok), np.zeros(1, np.int64)
        else:
            *tokenized, switches = tokenize_answers(doc.text, doc.trained_chars, tok, prefix=not doc.templated)
        for what, values in zip(("tokens", "breaks", "strong"), tokenized):
            self.ragged[what].append(values)
        self.loss_from.append(switches[:1])  # (its first trained token; the rest: the gaps, trained_spans.py)
        self.ragged["gaps"].append(switches[1:])
        for what, values in zip(("feat_idx", "feat_val"), head_features(doc.text)):
            self.ragged[what].append(values)
        self.names.write(json.dumps(doc.name) + "\n")
        self.n += 1

    def mark(self) -> tuple:
        return [w.mark() for w in self._writers()], self.names.tell(), self.n, self.raw

    def rollback(self, mark: tuple) -> None:
        marks, names_at, self.n, self.raw = mark
        for w, m in zip(self._writers(), marks):
            w.rollback(m)
        self.names.seek(names_at)
        self.names.truncate()

    def close(self) -> None:
        for w in self._writers():
            w.close()
        self.names.close()
