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
    # tokens the decode steps produced, where they ran on past `tokens`: speculation applies a stop string
    # after its rounds, which decoded to EOS or the limit (speculative.py speculate_one); None: from `tokens`
    decoded: int | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all but the first, which the prefill's logits give; an EOS
        counts) per second."""
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def decode_steps(self) -> int:
        """The tokens decode_seconds produced: `decoded` when set (the count cut tokens would make is not the
        work timed: a speculative stop string at the 5th of 64 tokens gave 4 / the 64 tokens' seconds)."""
        if self.decoded is not None:
            return self.decoded
        return max(0, len(self.tokens) + (self.finish_reason == "eos") - 1)

    @property
    def passes(self) -> int:
        """Target passes of speculative decoding (its verification calls; the prefill not counted)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per target pass, the replaced or bonus token included."""
        return (sum(self.accepted) + self.passes) / max(self.passes, 1)
