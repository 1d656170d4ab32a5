"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p.

Sampling draws from a `torch.Generator` seeded once per run (`--seed`), so a run is reproducible:
the same prompts, settings and seed give the same tokens. The draw happens on the logits' device
in fp32 (top-k and top-p are applied before the softmax, as transformers does: top-k first, then
the smallest set of tokens whose probability reaches top_p, the most likely token always kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no limit
    top_p: float = 1.0        # in (0, 1]; 1 = no limit
    seed: int = 0

    def problems(self) -> list[str]:
        out = []
        if not self.temperature >= 0:
            out.append(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            out.append(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p must be in (0, 1] (1 = no limit), got {self.top_p}")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator | None:
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [rows, vocab] with every token outside the top-k / top-p set at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row [rows] from its logits [rows, vocab]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
