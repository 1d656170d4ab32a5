"""Generation on one device: chunked prefill into a preallocated KV cache, then batched decoding.

- Prompts of one length are prefilled together, in chunks of `prefill_chunk` tokens (each chunk's
  queries attend to the cache so far plus themselves, models/cache.py), so a long prompt never
  builds an [S, S] transient. Prompts are ordered by length so that each group is a contiguous
  range of cache rows (a view, no copy), and no padding token is ever computed in prefill.
- All prompts then decode together, one token per row per step: rows hold different lengths, so
  the attention masks each row's keys to the slots it holds (one kernel call per layer); a row that
  has finished keeps being fed (its outputs are ignored) until every row is done. That padding is
  the only waste, and it is masked: a finished row's tokens never reach another row.
- The first new token comes from the prefill's last logits; each decode step is one model call on
  one token per row and one host read of the chosen tokens (for EOS, stop strings and streaming).

Rates are per prompt: its own tokens over the wall time of the calls it took part in (prefill: its
length group's chunks; decode: the steps until it finished).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.cache import KVCache
from .sampling import Sampling, next_tokens

GREEDY = Sampling()


@dataclass
class Result:
    """One prompt's generation."""

    prompt_tokens: int
    tokens: list[int]           # the new token ids (EOS not included; a stop string's last token included)
    finish_reason: str          # "eos", "stop" (a stop string, see generate's `stop`) or "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all but the first, which the prefill's logits give) per second."""
        steps = max(0, len(self.tokens) + (self.finish_reason == "eos") - 1)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def prefill(model, cache: KVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed `tokens` [rows, length] (rows of one length, appended to what `cache` holds) chunk by
    chunk; the logits [rows, vocab] (fp32) of the last position."""
    length = tokens.shape[1]
    chunk = chunk if chunk > 0 else length
    for start in range(0, length, chunk):
        hidden = model.hidden_states(tokens[:, start:start + chunk], cache=cache)
    return model.logits(hidden[:, -1]).float()


class LocalGeneration:
    """The engine's backend on one device: a KVCache, and the prompt fed in chunks. Under a head x ctx
    layout, parallel/generation.py's ShardedGeneration takes its place (a sharded cache, and a
    prefill through training's 2D attention)."""

    def cache(self, model, batch: int, max_len: int, core=None) -> KVCache:
        return KVCache.for_model(model, batch, max_len, core=core)

    def prefill(self, model, cache: KVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        return prefill(model, cache, tokens, chunk)


LOCAL = LocalGeneration()


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None, cache_core=None,
             device: torch.device | None = None, backend=LOCAL) -> list[Result]:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` (one for all, or per
    prompt) tokens. A row ends at an EOS token (not included), when `stop(row, tokens)` says so
    after a token (a stop string: the tokens so far are kept), or at its limit. `on_token(row,
    token)` sees every new token as it is chosen (streaming, progress). `cache_core` replaces the
    cache's attention core (models/cache.py); `backend` makes the cache and runs the prefill
    (LocalGeneration, or parallel/generation.py's ShardedGeneration on every rank of a layout,
    which then all return the same results). Results are in the order of `prompts`."""
    if not prompts:
        return []
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = device or model.tok_embeddings.weight.device
    eos = set(int(e) for e in eos_ids)
    # cache rows in order of length, so each length group is a contiguous range of rows
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    # a finished row is fed until every row is done, so each row may take the largest limit of steps
    max_len = max(len(p) for p in prompts) + max(limits)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            cache = backend.cache(model, n, max_len, core=cache_core)
            logits = torch.empty(n, model.cfg.vocab_size, device=device)
            prefill_s = [0.0] * n
            row = 0
            while row < n:
                length = len(prompts[order[row]])
                end = row
                while end < n and len(prompts[order[end]]) == length:
                    end += 1
                t0 = time.perf_counter()
                tokens = torch.tensor([list(prompts[order[r]]) for r in range(row, end)], dtype=torch.long,
                                      device=device)
                logits[row:end] = backend.prefill(model, cache.rows(row, end), tokens, prefill_chunk)
                seconds = time.perf_counter() - t0
                for r in range(row, end):
                    prefill_s[r] = seconds
                row = end
            return _decode(model, cache, logits, order, [len(prompts[i]) for i in order], [limits[i] for i in order],
                           prefill_s, sampling, eos, stop, on_token, n)
    finally:
        model.train(was_training)


def _decode(model, cache, logits, order, lengths, limits, prefill_s, sampling, eos, stop, on_token, n) -> list[Result]:
    generator = sampling.generator(logits.device)
    out: list[list[int]] = [[] for _ in range(n)]
    reason: list[str | None] = [None] * n
    decode_s = [0.0] * n
    for r in range(n):
        if limits[r] <= 0:
            reason[r] = "length"
    t0 = time.perf_counter()
    while True:
        chosen = next_tokens(logits, sampling, generator)
        host = chosen.tolist()  # the one host read per step
        elapsed = time.perf_counter() - t0
        for r in range(n):
            if reason[r] is not None:
                continue
            token = host[r]
            decode_s[r] = elapsed
            if token in eos:
                reason[r] = "eos"
                continue
            out[r].append(token)
            if on_token is not None:
                on_token(order[r], token)
            if stop is not None and stop(order[r], out[r]):
                reason[r] = "stop"
            elif len(out[r]) >= limits[r]:
                reason[r] = "length"
        if all(x is not None for x in reason):
            break
        logits = model(chosen[:, None], cache=cache)[:, -1].float()
    results: list[Result | None] = [None] * n
    for r in range(n):
        results[order[r]] = Result(lengths[r], out[r], reason[r], prefill_s[r], decode_s[r])
    return results
