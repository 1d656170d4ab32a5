"""Documents -> fixed-length training windows with labels, positions and document ids.

Documents are tokenised, each followed by EOS, concatenated and cut into windows of `seq_len`
tokens (the classic concatenate-and-chop packing; smarter packing is data/pack.py's job).
Every window carries its packing metadata, so attention can stay inside documents and RoPE
positions restart at each document:

- `tokens[i]`, `labels[i] = tokens[i + 1]` (the next token in the stream);
- `doc_ids[i]`: which document (numbered within the window) token i belongs to;
- `positions[i]`: i's offset from the start of its document's part in this window;
- with document masks, a label that lies in the next document is -100 (ignored): under a
  document mask the model cannot see that document, so predicting its first token is noise.

Documents are assigned to the train or eval split by a hash of their name, which is stable when
documents are added or removed.
"""

from __future__ import annotations

from ..errors import DataError

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from .corpus import Document

IGNORE = -100


@dataclass
class Batch:
    tokens: torch.Tensor     # [batch, seq] int64
    labels: torch.Tensor     # [batch, seq] int64, -100 = ignore
    positions: torch.Tensor  # [batch, seq] int64
    doc_ids: torch.Tensor | None  # [batch, seq] int64, or None without document masks

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.labels), move(self.positions), move(self.doc_ids))

    @property
    def valid_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def is_eval_doc(name: str, eval_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 1_000_000 < eval_fraction * 1_000_000


class TokenWindows:
    """A token stream cut into windows of seq_len (+1 for the shifted labels)."""

    def __init__(self, token_arrays: list[np.ndarray], eos_id: int, seq_len: int, doc_mask: bool):
        if not token_arrays:
            raise DataError("no documents to build windows from")
        lengths = np.array([len(a) + 1 for a in token_arrays], dtype=np.int64)
        self.tokens = np.empty(int(lengths.sum()), dtype=np.int32)
        self.doc = np.repeat(np.arange(len(token_arrays), dtype=np.int64), lengths)
        offset = 0
        for a, n in zip(token_arrays, lengths):
            self.tokens[offset:offset + n - 1] = a
            self.tokens[offset + n - 1] = eos_id
            offset += n
        self.seq_len, self.doc_mask = seq_len, doc_mask
        self.num_docs = len(token_arrays)
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"the corpus has {len(self.tokens)} tokens, fewer than one window of seq_len={seq_len} + 1; "
                f"use more documents or a shorter train.seq_len."
            )

    def __len__(self) -> int:
        return self.num_windows

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def window(self, i: int):
        start = i * self.seq_len
        stop = start + self.seq_len + 1
        toks = self.tokens[start:stop].astype(np.int64)
        doc = self.doc[start:stop]
        tokens, labels = toks[:-1], toks[1:].copy()
        if not self.doc_mask:
            return tokens, labels, np.arange(self.seq_len), None
        new_doc = np.empty(self.seq_len, dtype=bool)
        new_doc[0] = True
        new_doc[1:] = doc[1:-1] != doc[:-2]
        doc_ids = np.cumsum(new_doc) - 1
        idx = np.arange(self.seq_len)
        positions = idx - np.maximum.accumulate(np.where(new_doc, idx, 0))
        labels[doc[1:] != doc[:-1]] = IGNORE
        return tokens, labels, positions, doc_ids

    def batch(self, indices) -> Batch:
        parts = [self.window(int(i)) for i in indices]
        stack = lambda j: torch.from_numpy(np.stack([p[j] for p in parts])).long()  # noqa: E731
        return Batch(stack(0), stack(1), stack(2), stack(3) if self.doc_mask else None)


class WindowSampler:
    """Seeded, epoch-wise shuffled window order; its whole state is one global cursor."""

    def __init__(self, num_windows: int, seed: int):
        self.num_windows, self.seed, self.cursor = num_windows, seed, 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def next_indices(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, self.num_windows)
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, self._order(epoch)
            out.append(int(self._perm[pos]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if not is_eval_doc(d.name, eval_fraction)]
    evals = [d for d in docs if is_eval_doc(d.name, eval_fraction)]
    if not train:
        raise DataError("every document landed in the eval split; lower data.eval_fraction.")
    return train, evals
