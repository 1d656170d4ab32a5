"""What every training sample carries (`Batch`) and the sample order's global cursor.

A sample is one packed training sequence of `seq_len` tokens; samples come from the packed store
(data/loader.py). Every sample carries its packing metadata, so attention can stay inside
documents and RoPE positions restart at each document:

- `tokens[i]`, `labels[i] = tokens[i + 1]` (the next token in the stream);
- `doc_ids[i]`: which document (numbered within the sample) token i belongs to;
- `positions[i]`: i's offset from the start of its document's part in this sample;
- with document masks, a label that lies in the next document is -100 (ignored): under a
  document mask the model cannot see that document, so predicting its first token is noise.

Which documents went to the eval split was decided when the store was built (data/builder/holdout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.loss import scored_rows

IGNORE = -100


@dataclass
class Batch:
    tokens: torch.Tensor     # [batch, seq] int64
    labels: torch.Tensor     # [batch, seq] int64, -100 = ignore
    positions: torch.Tensor  # [batch, seq] int64
    doc_ids: torch.Tensor | None  # [batch, seq] int64, or None without document masks
    # [batch, seq] bool: False at padding (a packed sample's tokens past its documents: data/loader.py), which
    # MoE layers leave out of their router statistics and capacity (models/moe_stats.py); None: every token
    real: torch.Tensor | None = None
    # [batch, seq] float32: each label's weight in the loss's sum (train.loss_weighting = sequence: 1 / the labels
    # of its sequence, data/sequence_weights.py); None: every label weighs 1
    label_weights: torch.Tensor | None = None
    # int64 [scored]: the flat index of the labels scored, made on the host by `to` (ops/loss.py scored_rows), so
    # the LM head runs over those rows only; None: over every row (most rows are scored)
    scored: torch.Tensor | None = None

    def to(self, device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        scored = scored_rows(self.labels) if self.scored is None and self.labels.device.type == "cpu" else self.scored
        return Batch(move(self.tokens), move(self.labels), move(self.positions), move(self.doc_ids), move(self.real),
                     move(self.label_weights), move(scored))

    @property
    def valid_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


class SampleOrder:
    """Seeded, epoch-wise shuffled sample order; its whole state is one global cursor."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.cursor = num_samples, seed, 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_indices(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, self.num_samples)
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, self._order(epoch)
            out.append(int(self._perm[pos]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
