"""What one generated continuation is: the one result type of plain, chain-speculative and tree (CaPE)
decoding (generate/loop.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Result:
    """One prompt's (or one of its samples') continuation."""

    prompt_tokens: int
    tokens: list[int]           # the new token ids (EOS not included; a stop string's last token included)
    finish_reason: str          # "eos", "stop" (a stop string, see generate's `stop`) or "length"
    prefill_seconds: float      # its prefill call(s)
    decode_seconds: float       # from the first token's choice to its last token's
    sample: int = 0             # which of the prompt's num_samples continuations
    seed: int | None = None     # the seed its draws came from (None when greedy)
    logprobs: list[float] | None = None  # each new token's log-probability (generate's `logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token, the top (id, log-probability)
    # speculative decoding, per target pass (a round): the proposals kept and made (plain decoding: none)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    unused: int = 0  # kept proposals of the last pass after the row's end (EOS, stop, limit): verified, not emitted
    # --compile: compiles of an already compiled step during this result's generation (its batch's), after the
    # warm-up (generate/cli.py; models/recompiles.py); None without --compile
    compile_recompiles: int | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all but the first, which the prefill's logits give; an EOS
        counts) per second."""
        steps = max(0, len(self.tokens) + (self.finish_reason == "eos") - 1)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def passes(self) -> int:
        """Target passes of speculative decoding (its verification calls; the prefill not counted)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass, the replaced or bonus token included (the last pass's kept
        proposals after the end not: `unused`)."""
        return (sum(self.accepted) - self.unused + self.passes) / max(self.passes, 1)
