"""Choosing the next token from logits: the logits processors of transformers and vLLM, then greedy or
sampling, with one random stream per request.

The processors run in transformers' order (`GenerationMixin._get_logits_processor`):
1. on the raw logits (fp32), whatever the decoding:
   - repetition penalty (transformers' RepetitionPenaltyLogitsProcessor): every token that occurs in
     the prompt or the tokens generated so far has its logit divided by the penalty when positive,
     multiplied by it when negative (once, however often it occurs);
   - presence and frequency penalties (vLLM's and OpenAI's; transformers has none), after the
     repetition penalty as in vLLM: `logit -= frequency * count + presence * (count > 0)`, counting the
     generated tokens only (not the prompt);
   - min_new_tokens (transformers' MinNewTokensLengthLogitsProcessor): the EOS tokens at -inf while a
     row has fewer new tokens than that;
2. then, sampling only (temperature > 0): temperature, top-k, top-p (the smallest set of tokens whose
   probability reaches top_p, the most likely always kept), min-p (transformers' MinPLogitsWarper: drop a
   token whose probability, after the steps before, is below min_p x the top token's).
Greedy (temperature 0) takes the argmax of step 1's logits, as transformers' do_sample=False does. The
"processed" logits (`process`) are those the choice is made from; their log_softmax is what
`--logprobs` reports, as transformers' `output_scores` (not `output_logits`, the raw ones).

Seeds. A request (a prompt, or one of its --num-samples continuations) draws from its own stream: a
`torch.Generator` on the host seeded with the request's seed, one uniform (float64) per decode step,
turned into a token by the inverse of the distribution's CDF on the logits' device. So a request's
tokens depend only on its prompt, its seed and the settings, never on the other rows of the batch or
the batch size, and every rank of a sharded layout (which holds the same logits) draws the same. A
prompt's seed is its own ("seed" in the prompts file, or `generate(seeds=...)`), else
`derive_seed(run seed, the prompt's index)`; sample s of a prompt of seed P uses `sample_seed(P, s)`
(P itself for sample 0). `derive_seed` is splitmix64 (Steele et al.'s finaliser) of
seed + (index + 1) x 0x9E3779B97F4A7C15, kept to 63 bits.

Not finite. A distribution with NaN or inf in it (the model's logits NaN or inf, or logits / T past
fp32's 3.4e38) is an error (NonFiniteLogits), never a token. A temperature below MIN_TEMPERATURE
(1e-30) is refused with the other settings, before any work: below it the logits that overflow come
within reach of real models (at 1e-36, a logit of 340), and sampling there is greedy decoding but for
exact ties anyway. The small ones people use for "greedy through the sampler" (1e-5, 1e-6) are
allowed: nothing overflows there (a logit would have to pass 3e33 at 1e-5), and refusing them would
break commands that work. The check adds no host sync of its own on a GPU (draw). Greedy decoding too:
a row whose processed logits hold NaN or +inf, or are all -inf, is chosen as UNCHOSEN (-1) on the
device (`greedy_choice`), and the decode loop's host read of the tokens raises (`check_chosen`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError, UserError

PENALTY_RANGE = 2.0  # presence / frequency penalties: vLLM's and OpenAI's [-2, 2]
# the smallest temperature > 0: logits / T stays within fp32 (3.4e38) for any |logit| below 3.4e8
MIN_TEMPERATURE = 1e-30
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no limit
    top_p: float = 1.0        # in (0, 1]; 1 = no limit
    seed: int = 0             # the run's seed: a prompt without its own seed uses derive_seed(seed, index)
    min_p: float = 0.0        # in [0, 1]; 0 = no limit
    repetition_penalty: float = 1.0  # > 0; 1 = none (transformers'; < 1 rewards repetition)
    presence_penalty: float = 0.0    # in [-2, 2] (vLLM's; < 0 rewards repetition)
    frequency_penalty: float = 0.0   # in [-2, 2]
    min_new_tokens: int = 0          # EOS suppressed until a row has this many new tokens

    def problems(self) -> list[str]:
        out = []
        if not self.temperature >= 0:
            out.append(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        elif not math.isfinite(self.temperature):
            out.append(f"--temperature must be finite, got {self.temperature} (a large one flattens the distribution "
                       f"towards uniform; an infinite one makes it NaN)")
        elif 0 < self.temperature < MIN_TEMPERATURE:
            out.append(f"--temperature {self.temperature:g} is too small: below {MIN_TEMPERATURE:g}, logits divided by "
                       f"it can overflow fp32 to inf (a logit of 340 does at 1e-36), which leaves no distribution to "
                       f"draw from. Use --temperature 0 for greedy decoding (what so small a temperature amounts to), "
                       f"or {MIN_TEMPERATURE:g} or more")
        if self.top_k < 0:
            out.append(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p must be in (0, 1] (1 = no limit), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            out.append(f"--min-p must be in [0, 1] (0 = no limit), got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:  # (inf: a repeat's logit 0 or -inf, no penalty's scale)
            out.append(f"--repetition-penalty must be > 0 and finite (1 = none, above 1 penalises, below 1 rewards a "
                       f"repeat), got {self.repetition_penalty}")
        for flag, value in (("--presence-penalty", self.presence_penalty),
                            ("--frequency-penalty", self.frequency_penalty)):
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                out.append(f"{flag} must be in [-2, 2] (vLLM's and OpenAI's range; 0 = none), got {value}")
        if self.min_new_tokens < 0:
            out.append(f"--min-new-tokens must be >= 0, got {self.min_new_tokens}")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether a token's logit depends on the tokens before it (a penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def generator(self, device, seed: int | None = None) -> torch.Generator | None:
        """A generator seeded with `seed` (default: the run's), None when greedy."""
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed if seed is None else seed)


GREEDY = Sampling()  # temperature 0, no penalties: plain greedy decoding


def derive_seed(seed: int, index: int) -> int:
    """A seed for item `index` of a run (or sample `index` of a prompt) seeded `seed`: splitmix64 of
    seed + (index + 1) x golden ratio, 63 bits. Different indices give unrelated streams."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample `sample` of a prompt seeded `seed`: the prompt's own for sample 0."""
    return seed if sample == 0 else derive_seed(seed, sample)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Logits [rows, vocab] with every token outside the top-k / top-p / min-p set at -inf (in that
    order, each on what the one before left, as transformers' warpers)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        # (the top token's probability is its own maximum: it is always kept)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Step 2 (sampling only): temperature, top-k, top-p, min-p on fp32 logits [rows, vocab]."""
    return filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)


class Processors:
    """Step 1's state for a batch of rows: which tokens each row has seen (prompt and new: the
    repetition penalty), how often it generated each (presence / frequency), how many new tokens it
    has (min_new_tokens). Rows [rows, vocab] of bool / int32 on the logits' device, only for the
    penalties asked for."""

    def __init__(self, sampling: Sampling, prompts: Sequence[Sequence[int]], vocab: int, eos_ids: Sequence[int],
                 device):
        self.sampling, self.new = sampling, [0] * len(prompts)
        rows = len(prompts)
        self.seen = self.counts = None
        if sampling.repetition_penalty != 1.0:
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            for r, p in enumerate(prompts):
                self.seen[r, torch.as_tensor(list(p), dtype=torch.long, device=device)] = True
        if sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        # (an EOS id outside the vocabulary, which a config.json may name, is never generated: nothing to hold
        # back, as transformers' MinNewTokensLengthLogitsProcessor ignores it; it indexed past the logits)
        eos = sorted({int(e) for e in eos_ids if 0 <= int(e) < vocab})
        self.eos = torch.as_tensor(eos, dtype=torch.long, device=device) if sampling.min_new_tokens > 0 and eos \
            else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Step 1 on fp32 logits [rows, vocab]."""
        s = self.sampling
        logits = logits.float()
        if self.seen is not None:
            p = s.repetition_penalty
            logits = torch.where(self.seen, torch.where(logits < 0, logits * p, logits / p), logits)
        if self.counts is not None:
            logits = logits - s.frequency_penalty * self.counts - s.presence_penalty * (self.counts > 0)
        if self.eos is not None:
            short = [r for r, n in enumerate(self.new) if n < s.min_new_tokens]
            if short:
                rows = torch.as_tensor(short, device=logits.device)
                logits = logits.clone()
                logits[rows[:, None], self.eos[None, :]] = float("-inf")
        return logits

    def copy(self) -> Processors:
        other = object.__new__(Processors)
        other.__dict__.update(self.__dict__)
        other.new = list(self.new)
        other.seen = None if self.seen is None else self.seen.clone()
        other.counts = None if self.counts is None else self.counts.clone()
        return other

    def chain(self, tokens: Sequence[int]) -> Processors:
        """From this one row's state, len(tokens) + 1 rows: row i as after tokens[:i] too (the positions
        of a speculative verification, each after the proposals before it)."""
        return self.paths([list(tokens[:i]) for i in range(len(tokens) + 1)])

    def paths(self, paths: Sequence[Sequence[int]]) -> Processors:
        """From this one row's state, one row per path: as after that path's tokens too (a speculative
        tree's nodes, each after its ancestors)."""
        other = object.__new__(Processors)
        other.__dict__.update(self.__dict__)  # (seen and counts replaced below)
        other.new = [self.new[0] + len(path) for path in paths]
        for name in ("seen", "counts"):
            state = getattr(self, name)
            if state is None:
                continue
            state = state[:1].repeat(len(paths), 1)
            for i, path in enumerate(paths):  # (a few rows: K + 1, or a tree's nodes)
                if not path:
                    continue
                ids = torch.as_tensor(list(path), dtype=torch.long, device=state.device)
                if name == "seen":
                    state[i, ids] = True
                else:
                    state[i].index_add_(0, ids, torch.ones(len(path), dtype=state.dtype, device=state.device))
            setattr(other, name, state)
        return other

    def chosen(self, tokens: torch.Tensor) -> None:
        """Each row's new token [rows] (a finished row's too: its state no longer matters)."""
        rows = torch.arange(len(tokens), device=tokens.device)
        if self.seen is not None:
            self.seen[rows, tokens] = True
        if self.counts is not None:
            self.counts[rows, tokens] += 1
        self.new = [n + 1 for n in self.new]


def process(logits: torch.Tensor, sampling: Sampling, processors: Processors | None = None) -> torch.Tensor:
    """The logits a token is chosen from [rows, vocab] fp32: step 1 (with `processors`' state), then,
    sampling, step 2. Their log_softmax is a token's reported log-probability."""
    logits = processors(logits) if processors is not None else logits.float()
    return logits if sampling.greedy else warp(logits, sampling)


class NonFiniteLogits(UserError, RuntimeError):
    """A row's distribution to draw from holds NaN or inf."""


UNCHOSEN = -1  # greedy_choice's token for a row that is no distribution


def greedy_choice(processed: torch.Tensor) -> torch.Tensor:
    """The argmax of processed logits [..., vocab], UNCHOSEN where a row holds NaN or +inf or only -inf
    (argmax would return the NaN's index, the overflow's, or 0). No host sync: a host read of the
    tokens (the decode loop's, `check_chosen`) finds it."""
    bad = (processed.isnan() | processed.isposinf()).any(-1) | ~(processed > float("-inf")).any(-1)
    return processed.argmax(dim=-1).masked_fill(bad, UNCHOSEN)


def check_chosen(token: int, what: str = "the greedy choice's") -> int:
    """`token`, read on the host; NonFiniteLogits when greedy_choice found no distribution."""
    if token == UNCHOSEN:
        raise NonFiniteLogits(
            f"decoding: {what} logits are not finite (NaN or +inf, or every token at -inf): the model's "
            f"logits hold NaN or inf (a diverged checkpoint, or an overflow in a reduced dtype). Check the "
            f"checkpoint and its dtype (--train.dtype fp32 shows whether the reduced precision overflows).")
    return token


def row_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One host generator per request, seeded with its seed."""
    return [torch.Generator().manual_seed(int(s) & _MASK64) for s in seeds]


def draw(processed: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row [rows] from processed logits [rows, vocab] (sampling): one float64 uniform from
    each row's generator, through the row's CDF (a token of probability 0 is never chosen). A row whose
    distribution is not finite is an error (NonFiniteLogits).

    Host syncs on a GPU: one, the check, once all of the draw's work is queued, so the decode loop's
    host read of the tokens right after it has nothing left to wait for; the uniforms go up without
    one (pinned, non-blocking). (Before the check, their blocking copy was this sync.)"""
    tokens, finite = _through_cdf(processed, _uniforms(generators, processed.device))
    if not bool(finite.all()):
        rows = (~finite).nonzero().flatten().tolist()
        raise NonFiniteLogits(
            f"sampling: the distribution of row{'s' * (len(rows) > 1)} {', '.join(map(str, rows))} is not finite "
            f"(NaN or inf in the processed logits): either the model's logits hold NaN or inf (a diverged "
            f"checkpoint, or an overflow in a reduced dtype), or the temperature is so small that logits / "
            f"temperature overflows fp32. Use a larger --temperature, or --temperature 0 for greedy decoding; "
            f"if the model's logits are not finite, check the checkpoint and its dtype.")
    return tokens


def inverse_cdf(processed: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`draw`'s tokens [rows] for the rows' uniforms [rows] float64, without its check: UNCHOSEN where a
    row's distribution is not finite, found by the decode loop's host read (check_chosen), so a compiled
    decode step (generate/blocks.py) has no host sync."""
    tokens, finite = _through_cdf(processed, uniforms)
    return tokens.masked_fill(~finite, UNCHOSEN)


def _through_cdf(processed: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token at its uniform `u` through the CDF of processed logits [rows, vocab] (float64
    sums), and whether the row's total is finite."""
    cdf = processed.softmax(dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1]
    x = (u * total).unsqueeze(-1)  # < the row's total for u < 1, so the index is < vocab when total is finite
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return tokens, torch.isfinite(total)


def _uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """One float64 uniform from each row's host generator [rows], on `device` (on a GPU without a sync)."""
    values = [float(torch.rand((), dtype=torch.float64, generator=g)) for g in generators]
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.float64, device=device)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator] | None = None,
                processors: Processors | None = None) -> torch.Tensor:
    """The next token of each row [rows] from its logits [rows, vocab] (one generator per row when
    sampling)."""
    processed = process(logits, sampling, processors)
    return greedy_choice(processed) if sampling.greedy else draw(processed, generators)
