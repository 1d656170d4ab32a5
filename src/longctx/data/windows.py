"""What every training window carries, the eval split rule and the sampler's global cursor.

Windows themselves come from the packed store (data/loader.py). Every window carries its packing
metadata, so attention can stay inside documents and RoPE positions restart at each document:

- `tokens[i]`, `labels[i] = tokens[i + 1]` (the next token in the stream);
- `doc_ids[i]`: which document (numbered within the window) token i belongs to;
- `positions[i]`: i's offset from the start of its document's part in this window;
- with document masks, a label that lies in the next document is -100 (ignored): under a
  document mask the model cannot see that document, so predicting its first token is noise.

Documents are assigned to the train or eval split by a hash of their name, which is stable when
documents are added or removed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

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
