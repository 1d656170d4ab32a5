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

Not finite: a target row with NaN or inf is an error (NonFiniteLogits), never a kept proposal (a NaN
ratio compares as "keep"); a draft row too when sampling (its q enters the ratio). Greedy, the draft's
own NaN only costs its proposals: the target's verification decides every token.
"""

from __future__ import annotations

import math

import torch

from .sampling import UNCHOSEN, Processors, Sampling, check_chosen, greedy_choice, process


def sampling_probs(logits: torch.Tensor, sampling: Sampling, processors: Processors | None = None) -> torch.Tensor:
    """The distribution a token is drawn from (fp32 [rows, vocab]): the penalties and min_new_tokens
    (`processors`: each row's state, the tokens before its position), then temperature, top-k, top-p
    and min-p (sampling.warp); greedy: one-hot on the argmax of the penalised logits."""
    return token_probs(process(logits, sampling, processors), sampling)


def token_probs(processed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution of processed logits (sampling.process): one-hot on the argmax when greedy."""
    if sampling.greedy:  # a row that is no distribution stays one (NaN), for `_argmax` to refuse
        choice = greedy_choice(processed)
        one_hot = torch.nn.functional.one_hot(choice.clamp(min=0), processed.shape[-1]).float()
        return one_hot.masked_fill((choice == UNCHOSEN)[..., None], float("nan"))
    return processed.softmax(-1)


def _argmax(probs: torch.Tensor) -> int:
    """The target's greedy token from one row of token_probs (one host read); NonFiniteLogits for a NaN row."""
    return check_chosen(int(greedy_choice(probs)), "the target's")


def choose(probs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """A token from `probs` [vocab]: the argmax when greedy, else a draw from `generator`."""
    if sampling.greedy:
        return _argmax(probs)
    if not bool(torch.isfinite(probs).all()):
        check_chosen(UNCHOSEN, "the target's")
    return int(torch.multinomial(probs, 1, generator=generator))


def accept(proposals: list[int], q: torch.Tensor, p: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[int, int]:
    """(how many proposals are kept, the token after them) for proposals d_1..d_K drawn from q
    [K, vocab], verified by the target's p [K + 1, vocab]: the greedy rule, or the rejection rule."""
    for i, d in enumerate(proposals):
        if sampling.greedy:
            if (choice := _argmax(p[i])) != d:
                return i, choice
            continue
        target, draft = float(p[i, d]), float(q[i, d])
        if not math.isfinite(target * draft):
            check_chosen(UNCHOSEN, "the target's" if not math.isfinite(target) else "the draft's")
        ratio = target / max(draft, 1e-30)
        if float(torch.rand((), generator=generator, device=p.device)) >= min(1.0, ratio):
            residual = (p[i] - q[i]).clamp(min=0)
            total = float(residual.sum())
            residual = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(proposals), choose(p[len(proposals)], sampling, generator)
