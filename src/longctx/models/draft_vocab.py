"""A draft's reduced vocabulary (`draft.vocab`): the draft proposes only the N tokens its training data
uses most, through those N rows of the target's LM head.

Why: a draft without an LM head of its own runs the target's every step, and a real target's head is a
large part of it (SmolLM2-135M: 49,152 x 576, a fifth of its parameters; on a CPU at batch 1 reading it
costs about a quarter of a target step). The N most frequent tokens of a corpus cover nearly all of a
text like it (EAGLE-3 drafts over 32K of Llama-3's 128K), and reading N rows is V / N times cheaper.

Lossless all the same: the draft's distribution is put back on the full vocabulary (zero outside the
N tokens: logits -inf), so the verification rules see an ordinary draft distribution q that never
proposes a token outside them; the target, which has the whole vocabulary, decides what is kept.

Training: the draft's logits are over the N tokens, and so is its teacher (distillation, draft.loss =
kd: the target's distribution renormalised over them: what the draft can express); next-token
cross-entropy (ce) ignores labels outside them.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


class DraftVocab(nn.Module):
    """The ids [N] of a draft's vocabulary (ascending), saved with the draft (a persistent buffer),
    and the target's head rows for them (gathered once per head tensor, not per step)."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("ids", torch.zeros(size, dtype=torch.long))
        self._rows: tuple[weakref.ref, tuple, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.ids.numel()

    def head(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head `weight` [V, dim] for this vocabulary: [N, dim]. Cached
        by the head tensor (a weak reference: an id alone is reused by the next tensor allocated after
        it is freed, e.g. another target's head) and its version, and by the ids' version (a checkpoint's
        ids are copied in place; loading a state dict clears it too, for ids made under inference mode,
        which keep no version), so a decode step does not copy N rows each time."""
        key = (_version(weight), weight.dtype, weight.device, self.ids.data_ptr(), _version(self.ids))
        cached = self._rows
        if (cached is None or cached[0]() is not weight or cached[1] != key
                or torch.is_grad_enabled() and weight.requires_grad):
            cached = self._rows = (weakref.ref(weight), key, weight.index_select(0, self.ids))
        return cached[2]

    def _load_from_state_dict(self, *args, **kwargs):
        self._rows = None  # (the ids change in place)
        super()._load_from_state_dict(*args, **kwargs)

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Logits [..., N] over this vocabulary as logits [..., V] over the target's: -inf elsewhere
        (probability 0 after a softmax: a token the draft never proposes)."""
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        full[..., self.ids] = logits
        return full

    def labels(self, labels: torch.Tensor, ignore: int, vocab_size: int) -> torch.Tensor:
        """Target-vocabulary labels (ids < vocab_size, or `ignore`) as indices into this vocabulary;
        `ignore` where a label is outside it. No host read (a training step calls it)."""
        index = torch.full((vocab_size,), ignore, dtype=torch.long, device=labels.device)
        index[self.ids] = torch.arange(self.size, device=labels.device)
        return torch.where(labels >= 0, index[labels.clamp(min=0)], torch.full_like(labels, ignore))

    @torch.no_grad()
    def set_from_counts(self, counts: torch.Tensor) -> float:
        """The N most frequent ids of `counts` [V] (ties to the lower id), ascending; returns the share
        of the counted tokens they cover."""
        if counts.numel() < self.size:
            raise ValueError(f"a draft vocabulary of {self.size} tokens from counts over {counts.numel()}")
        order = torch.argsort(counts, descending=True, stable=True)
        chosen = torch.sort(order[:self.size]).values
        self.ids.copy_(chosen)
        self._rows = None
        total = float(counts.sum())
        return float(counts[chosen].sum()) / total if total else 0.0


def _version(t: torch.Tensor) -> int | None:
    """A tensor's version counter (bumped by every in-place write); None for an inference tensor, which
    keeps none."""
    return None if t.is_inference() else t._version
