"""The acceptance rule of speculative decoding: which of a draft's proposals the target keeps, and the
token after them.

Greedy (T = 0): d_i is kept while it is the target's argmax; the first disagreement is replaced by
the target's own choice, and when every d_i is kept the target's next choice is a bonus token. So the
output is token-identical to plain greedy decoding. Sampling (T > 0), the rejection rule of
speculative sampling (Leviathan et al., Chen et al.): d_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); the first rejected position draws from norm(max(0, p_i - q_i)); when all
are kept the bonus draws from p_{K+1}. The tokens are then distributed exactly as the target's own
sampling, as long as p and q are the processed distributions (`sampling_probs`: every processor of
generate/sampling.py applied to both sides alike).
"""

from __future__ import annotations

import torch

from .sampling import Processors, Sampling, process


def sampling_probs(logits: torch.Tensor, sampling: Sampling, processors: Processors | None = None) -> torch.Tensor:
    """The distribution a token is drawn from (fp32 [rows, vocab]): the penalties and min_new_tokens
    (`processors`: each row's state, the tokens before its position), then temperature, top-k, top-p
    and min-p (sampling.warp); greedy: one-hot on the argmax of the penalised logits."""
    return token_probs(process(logits, sampling, processors), sampling)


def token_probs(processed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution of processed logits (sampling.process): one-hot on the argmax when greedy."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(processed.argmax(-1), processed.shape[-1]).float()
    return processed.softmax(-1)


def choose(probs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """A token from `probs` [vocab]: the argmax when greedy, else a draw from `generator`."""
    return int(probs.argmax()) if sampling.greedy else int(torch.multinomial(probs, 1, generator=generator))


def accept(proposals: list[int], q: torch.Tensor, p: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[int, int]:
    """(how many proposals are kept, the token after them) for proposals d_1..d_K drawn from q
    [K, vocab], verified by the target's p [K + 1, vocab]: the greedy rule, or the rejection rule."""
    for i, d in enumerate(proposals):
        if sampling.greedy:
            if int(p[i].argmax()) != d:
                return i, int(p[i].argmax())
            continue
        ratio = float(p[i, d]) / max(float(q[i, d]), 1e-30)
        if float(torch.rand((), generator=generator, device=p.device)) >= min(1.0, ratio):
            residual = (p[i] - q[i]).clamp(min=0)
            total = float(residual.sum())
            residual = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(proposals), choose(p[len(proposals)], sampling, generator)
