"""Reading a packed store for training: samples -> tokens, labels, positions, document ids.

`PackedSamples` is a store split seen as one list of samples (over all parts): `len`,
`batch(indices)`, `num_tokens`. In sample i:

- `labels[t] = tokens[t + 1]` inside a segment; the last token of a segment has no label in this
  sample (its document ends, or continues in another sample), nor does padding: IGNORE (-100);
- `doc_ids` number the sample's segments 0, 1, ...; padding gets the next id of its own, so it
  never attends to real tokens and they never attend to it;
- `positions` restart at 0 at every segment (and in the padding).

Without document masks (`doc_mask=False`) a sample is a plain causal sequence: labels run across
segment boundaries, positions are 0..L-1, no doc ids; padding, always at the end, stays ignored.

`BatchLoader` draws global batches: a seeded shuffle of the samples whose whole state is one
global cursor (`SampleOrder`), so a resumed job continues with exactly the samples not yet seen
under any data-parallel degree; with `dp > 1` each batch is permuted so that the dp blocks
`Runtime.local_batch` hands out have balanced estimated cost (data/balance.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .balance import balanced_order
from .samples import IGNORE, Batch, SampleOrder
from .store import S_LENGTH, load_split, read_manifest

# what checkpoints saved before issue 19 call the sample count in the data position
LEGACY_COUNT_KEY = "num_windows"


class SampleSet:
    """What the loader needs of a list of samples, given `sample(i)`, `doc_mask` and per sample
    `real_tokens` and `sq_tokens` (the sum of squared document lengths): token counts, estimated
    costs, batches."""

    @property
    def num_tokens(self) -> int:
        return int(self.real_tokens.sum())

    def costs(self, a: float, b: float) -> np.ndarray:
        """Estimated work per sample: a * attention pairs + b * tokens."""
        quad = self.sq_tokens if self.doc_mask else self.real_tokens ** 2
        return a * quad + b * self.real_tokens

    def batch(self, indices) -> Batch:
        return stack_samples([self.sample(int(i)) for i in indices], self.doc_mask)


class PackedSamples(SampleSet):
    def __init__(self, root: str | Path, split: str = "train", doc_mask: bool = True):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.seq_len = int(self.manifest["seq_len"])
        self.doc_mask = doc_mask
        self.parts = [a for a in (load_split(self.root, p, split) for p in self.manifest["parts"]) if a is not None]
        counts = [len(a.pointer) - 1 for a in self.parts]
        self.offsets = np.cumsum([0, *counts])
        self.num_samples = int(self.offsets[-1])
        # per sample: real tokens and sum of squared segment lengths (for the cost estimate)
        real, sq = [], []
        for a in self.parts:
            w = np.repeat(np.arange(len(a.pointer) - 1), np.diff(a.pointer))  # each segment's sample
            n = len(a.pointer) - 1
            lens = a.segments[:, S_LENGTH].astype(np.float64)
            real.append(np.bincount(w, weights=lens, minlength=n))
            sq.append(np.bincount(w, weights=lens ** 2, minlength=n))
        self.real_tokens = np.concatenate(real) if real else np.zeros(0)
        self.sq_tokens = np.concatenate(sq) if sq else np.zeros(0)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def tokenizer_spec(self) -> str:
        return self.manifest["tokenizer"]["spec"]

    def _locate(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        p = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.parts[p], i - int(self.offsets[p])

    def segments(self, i: int) -> np.ndarray:
        part, j = self._locate(i)
        return part.segments[part.pointer[j]:part.pointer[j + 1]]

    def sample(self, i: int):
        part, j = self._locate(i)
        tokens = np.asarray(part.tokens[j], dtype=np.int64)
        segs = part.segments[part.pointer[j]:part.pointer[j + 1]]
        L = self.seq_len
        real = int(segs[:, S_LENGTH].sum())
        labels = np.full(L, IGNORE, dtype=np.int64)
        if not self.doc_mask:
            labels[:real - 1] = tokens[1:real]
            return tokens, labels, np.arange(L), None
        lengths = np.append(segs[:, S_LENGTH], L - real) if real < L else segs[:, S_LENGTH]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        doc_ids = np.repeat(np.arange(len(lengths)), lengths)
        positions = np.arange(L) - np.repeat(starts, lengths)
        nxt = np.zeros(L, dtype=bool)  # True where token t + 1 is in the same segment
        nxt[:-1] = doc_ids[1:] == doc_ids[:-1]
        nxt[real:] = False  # padding predicts nothing
        labels[:-1][nxt[:-1]] = tokens[1:][nxt[:-1]]
        return tokens, labels, positions, doc_ids

def stack_samples(parts: list[tuple], doc_mask: bool) -> Batch:
    """(tokens, labels, positions, doc ids) per sample -> one Batch."""
    stack = lambda j: torch.from_numpy(np.stack([p[j] for p in parts])).long()  # noqa: E731
    return Batch(stack(0), stack(1), stack(2), stack(3) if doc_mask else None)


class BatchLoader:
    """Global batches of `batch_size` samples in seeded order, cost-balanced over `dp` ranks."""

    def __init__(self, samples, batch_size: int, seed: int, dp: int = 1, balance: bool = True,
                 cost: tuple[float, float] = (1.0, 0.0)):
        if len(samples) == 0:
            raise DataError("the data store has no training samples; build it from more documents.")
        self.samples, self.batch_size, self.dp = samples, batch_size, dp
        self.order = SampleOrder(len(samples), seed)
        self.balance = balance and dp > 1 and hasattr(samples, "costs")
        self.costs = samples.costs(*cost) if self.balance else None

    def next_indices(self) -> list[int]:
        idx = self.order.next_indices(self.batch_size)
        return balanced_order(idx, self.costs, self.dp) if self.balance else idx

    def next_batch(self) -> Batch:
        return self.samples.batch(self.next_indices())

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("num_samples", state.get(LEGACY_COUNT_KEY))
        if saved is not None and int(saved) != len(self.samples):
            raise DataError(
                f"the checkpoint's data position is for {saved} training samples but the data has "
                f"{len(self.samples)}; resume with the same data (data.path / data.corpus and train.seq_len)."
            )
        if "seed" in state and int(state["seed"]) != self.order.seed:
            raise DataError(
                f"the checkpoint's data order was drawn with seed {state['seed']} but this run uses train.seed="
                f"{self.order.seed}; resuming would repeat some samples and skip others. Resume with "
                f"--train.seed {state['seed']}."
            )
        self.order.load_state_dict(state)


def cost_coefficients(model_cfg) -> tuple[float, float]:
    """(a, b) of a*s^2 + b*s: the model's forward FLOPs (metrics.py) of a document of s tokens are
    s * forward_flops_per_token(s), linear in s per token (causal attention), so b is the per-token
    cost at length 0 and a the attention slope."""
    from ..metrics import forward_flops_per_token

    b = forward_flops_per_token(model_cfg, 0)
    return float(forward_flops_per_token(model_cfg, 1) - b), float(b)
