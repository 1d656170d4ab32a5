"""`eval --mode generate`'s count of sequences, moving inside a batch of them (progress.py).

A length's phase counted whole sequences, each batch when its generation ended: during a long sequence the line
sat at "3/10 sequences" through its prefill and through the generation of its answer tokens. Here each sequence
is counted in two parts: its prefill's share, as the prefill's own phase counts its prompt tokens
(generate/prefill_progress.py; a prefill with no phase, one chunk, when it is done) and whole at the first new
token; then the rest token by token, each new token its share of the sequence's limit. The batch's count is made
whole when it ends (a row ended early by an EOS gives its last shares then). The count never goes back.

The prefill's share: for a length's first batch, the prefill's part of the sequence's model FLOPs (models/flops.py
prefill_flops: its prompt, against its prompt and its new tokens); after it, the part of the time the previous
batch of that length spent in its prefill (Result.prefill_seconds and decode_seconds), since a decode step reads
the whole cache for one token and takes far longer than its FLOPs' share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..models.flops import prefill_flops
from ..progress import Phase


@dataclass(frozen=True)
class _Batch:
    """One batch's count, replaced whole at each begin (a line reads it from the heartbeat's thread)."""
    base: float = 0.0                  # the count before the batch
    n: int = 0                         # its sequences
    prefill: float = 0.0               # the part of them its prefill stands for
    prompt_tokens: int = 0             # its prompts' tokens (what the prefill phases count)
    per_token: tuple = ()              # per row: the part of a sequence each new token stands for
    prefills: list = field(default_factory=list)  # the prefill phases run inside the batch so far


class SequenceCount:
    """Counts batches of sequences in `progress` (a length's phase, its total the sequences), by parts of each.
    `cfg`: the model's config (the first batch's prefill share), or None (a half)."""

    def __init__(self, progress: Phase, cfg=None):
        self.progress, self.cfg = progress, cfg
        self.measured: float | None = None  # the previous batch's prefill share of its time
        self.batch, self.tokens = _Batch(), 0.0
        progress.follow(self._prefilled)
        progress.watch_inner(self._inner)

    def _inner(self, phase: Phase) -> None:
        if phase.unit == "prompt tokens":  # (a prefill's: generate/prefill_progress.py)
            self.batch.prefills.append(phase)

    def prefill_share(self, prompt: int, new: int) -> float:
        """The part of a sequence of `prompt` tokens and up to `new` new ones its prefill stands for."""
        if self.measured is not None:
            return self.measured
        if self.cfg is None:
            return 0.5
        return prefill_flops(self.cfg, prompt) / prefill_flops(self.cfg, prompt + max(new, 1))

    def begin(self, prompts: Sequence[int], limits: Sequence[int]) -> None:
        """A batch of sequences with prompts of these lengths and these limits of new tokens starts."""
        shares = [self.prefill_share(p, n) for p, n in zip(prompts, limits)]
        self.tokens = 0.0
        self.batch = _Batch(self.progress.done, len(prompts), sum(shares), sum(prompts),
                            tuple((1 - s) / max(n, 1) for s, n in zip(shares, limits)))

    def _prefilled(self) -> float:
        """The count as the batch's prefill phases have it (Phase.follow: read when a line is said)."""
        b = self.batch
        done = sum(p.part() * (p.total or 0) for p in list(b.prefills))
        return b.base + b.prefill * min(done / b.prompt_tokens, 1.0) if b.prompt_tokens else b.base

    def on_token(self, row: int, token: int) -> None:
        """generate()'s on_token: the batch's row `row` took a new token (the first: every row's prefill done)."""
        b = self.batch
        self.tokens += b.per_token[row]
        # (one assignment, never below what a line said)
        self.progress.done = max(self.progress.done, min(b.base + b.prefill + self.tokens, b.base + b.n))

    def end(self, results=()) -> None:
        """The batch is done: its sequences whole (and the phase's bar moved by them). `results` (generate()'s):
        the next batch's prefill share, from their prefill and decode seconds."""
        b = self.batch
        self.progress.done = b.base + b.n
        if self.progress.bar is not None:
            self.progress.bar.update(b.n)
        prefill = sum(r.prefill_seconds for r in results)
        spent = prefill + sum(r.decode_seconds for r in results)
        if spent > 0:
            self.measured = prefill / spent
