"""Plain decoding: `generate`, batched, one token per row per round (the decode loop: generate/loop.py).

Each row is a request: its logits go through the processors (penalties, min_new_tokens, then
temperature, top-k, top-p, min-p: generate/sampling.py) and, sampling, it draws from its own seeded
stream, so its tokens never depend on the other rows. The first token comes from the prefill's last
logits; each later round is one model call on one token per row and one host read of the chosen
tokens (for EOS, stop strings and streaming). Rows hold different lengths, so the attention masks
each row's keys to the slots it holds (one kernel call per layer).

Rates are per prompt: its own tokens over the wall time of the calls it took part in (prefill: its
length group's chunks; decode: the rounds until it finished).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..models.static_decode import CompiledStep, compiled_step
from .blocks import block_size, decode_block
from .contracts import Backend, Cache, Round
from .local import LOCAL
from .loop import decode
from .results import Result
from .sampling import GREEDY, Processors, Sampling, derive_seed, draw, greedy_choice, process, row_generators


class PlainRounds:
    """Plain decoding's rounds (contracts.Rounds): each row's next token from its last logits, the
    prefill's first, then one cached model call on the chosen tokens per round; through a compiled step
    (cache.fast), a block of up to generate/blocks.py's BLOCK steps per round, read by the host once.
    `steps`: the decode steps a generation takes at most (the longest limit but the prefill's token), so
    a block never runs past it. `keep`: the rounds give the processed logits (logprobs)."""

    room = 0  # a round appends one token per row per step

    def __init__(self, model, sampling: Sampling, steps: int | None = None, keep: bool = True):
        self.model, self.sampling, self.keep = model, sampling, keep
        self.steps_left = steps if steps is not None else 0  # (None: no blocks, one step per round)
        self.generators = None
        self.chosen: torch.Tensor | None = None  # [rows] the last round's tokens, fed by the next

    def first(self, cache: Cache, logits: torch.Tensor, prompts, seeds, processors: Processors | None) -> Round:
        if not self.sampling.greedy:
            self.generators = row_generators(seeds)
        return self._choose(logits, processors)

    def next(self, cache: Cache, processors: Processors | None) -> Round:
        steps = block_size(cache, self.steps_left)
        self.steps_left -= max(steps, 1)
        if steps:
            taken = decode_block(self.model, cache, self.chosen, steps, self.sampling, self.generators, processors,
                                 self.keep)
            self.chosen = taken.tokens[:, -1]
            return taken
        return self._choose(self.model(self.chosen[:, None], cache=cache)[:, -1].float(), processors)

    def _choose(self, logits: torch.Tensor, processors: Processors | None) -> Round:
        processed = process(logits, self.sampling, processors)
        self.chosen = greedy_choice(processed) if self.sampling.greedy else draw(processed, self.generators)
        return Round(self.chosen[:, None], processed[:, None])


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None, cache_core=None,
             device: torch.device | None = None, backend: Backend = LOCAL, seeds: Sequence[int] | None = None,
             num_samples: int = 1, logprobs: int | None = None, compile: bool | CompiledStep = False) -> list[Result]:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` (one for all, or per
    prompt) tokens. A row ends at an EOS token (not included; `eos_ids=()` ignores EOS, as
    --ignore-eos), when `stop(row, tokens)` says so after a token (a stop string: the tokens so far
    are kept), or at its limit. `on_token(row, token)` sees every new token as it is chosen
    (streaming, progress). `row` is the result's index. `cache_core` replaces the cache's attention
    core (models/kv_cache.py); `backend` makes the cache and runs the prefill (generate/local.py's
    LocalGeneration, or generate/sharded.py's ShardedGeneration on every rank of a layout, which
    then all return the same results).

    Sampling (generate/sampling.py): prompt i draws from its own stream, seeded `seeds[i]` (default
    derive_seed(sampling.seed, i)), so its tokens do not depend on the other prompts or the batch.
    `num_samples`: N continuations per prompt (sample s seeded sample_seed(seed, s)); the prompt is
    prefilled once and its cache rows copied. `logprobs`: None (off), 0 (each new token's
    log-probability) or N (also the top N (id, log-probability) per position), from the processed
    logits the token was chosen from (sampling.process). Results are prompt-major: prompt 0's samples
    0..N-1, then prompt 1's, ... (transformers' num_return_sequences order). `compile`: decode steps
    through a compiled static-shape step (models/static_decode.py; True: a new CompiledStep) on one
    device, the same tokens as eager."""
    if not prompts:
        return []
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be >= 0 (or None), got {logprobs}")
    seeds = [derive_seed(sampling.seed, i) for i in range(n)] if seeds is None else [int(x) for x in seeds]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts")
    rounds = PlainRounds(model, sampling, steps=max(limits, default=1) - 1, keep=logprobs is not None)
    return decode(model, prompts, rounds, limits=limits, seeds=seeds, sampling=sampling,
                  backend=backend, num_samples=num_samples, eos_ids=eos_ids, prefill_chunk=prefill_chunk, stop=stop,
                  on_token=on_token, cache_core=cache_core, device=device, logprobs=logprobs,
                  compiled=compiled_step(compile))
