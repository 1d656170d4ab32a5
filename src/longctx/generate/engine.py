"""Generation on one device: chunked prefill into a preallocated KV cache, then batched decoding.

- Prompts are ordered by length, so that every prefill call fills a contiguous range of cache rows
  (a view, no copy). Short prompts of different lengths are prefilled together in one flat call
  (varlen: concatenated, positions restarting and attention masked per prompt, as packed documents
  train), up to `prefill_chunk` tokens per call; their keys and values go to their rows as each
  layer makes them. A longer prompt (and its equals in length) is prefilled in chunks of
  `prefill_chunk` tokens (each chunk's queries attend to the cache so far plus themselves,
  models/cache.py), so it never builds an [S, S] transient. No padding token is ever computed in
  prefill.
- All prompts then decode together, one token per row per step: rows hold different lengths, so
  the attention masks each row's keys to the slots it holds (one kernel call per layer); a row that
  has finished keeps being fed (its outputs are ignored) until every row is done. That padding is
  the only waste, and it is masked: a finished row's tokens never reach another row.
- The first new token comes from the prefill's last logits; each decode step is one model call on
  one token per row and one host read of the chosen tokens (for EOS, stop strings and streaming).
- Each row is a request: its logits go through the processors (penalties, min_new_tokens, then
  temperature, top-k, top-p, min-p: generate/sampling.py) and, sampling, it draws from its own
  seeded stream, so its tokens never depend on the other rows. A prompt's `num_samples` rows share
  its prefill (the rows copied).

Rates are per prompt: its own tokens over the wall time of the calls it took part in (prefill: its
length group's chunks; decode: the steps until it finished).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .local import LOCAL
from .sampling import Processors, Sampling, derive_seed, draw, process, row_generators, sample_seed

GREEDY = Sampling()


@dataclass
class Result:
    """One prompt's generation."""

    prompt_tokens: int
    tokens: list[int]           # the new token ids (EOS not included; a stop string's last token included)
    finish_reason: str          # "eos", "stop" (a stop string, see generate's `stop`) or "length"
    prefill_seconds: float
    decode_seconds: float
    sample: int = 0             # which of the prompt's num_samples continuations
    seed: int | None = None     # the seed its draws came from (None when greedy)
    logprobs: list[float] | None = None  # each new token's log-probability (generate's `logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token, the top (id, log-probability)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all but the first, which the prefill's logits give) per second."""
        steps = max(0, len(self.tokens) + (self.finish_reason == "eos") - 1)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def prefill_calls(lengths: Sequence[int], chunk: int, flat: bool) -> list[tuple[bool, int, int]]:
    """The prefill calls for prompts of `lengths` (ascending): (flat, first row, end row). With
    `flat`, consecutive prompts of up to `chunk` tokens in all share a call; a longer prompt, with
    the prompts of its length, is one chunked call."""
    calls, i, n = [], 0, len(lengths)
    while i < n:
        j, total = i, 0
        if flat and lengths[i] <= chunk:
            while j < n and total + lengths[j] <= chunk:
                total += lengths[j]
                j += 1
            if lengths[j - 1] != lengths[i]:
                calls.append((True, i, j))
                i = j
                continue
            j = i
        while j < n and lengths[j] == lengths[i]:
            j += 1
        calls.append((False, i, j))
        i = j
    return calls



def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None, cache_core=None,
             device: torch.device | None = None, backend=LOCAL, seeds: Sequence[int] | None = None,
             num_samples: int = 1, logprobs: int | None = None) -> list[Result]:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` (one for all, or per
    prompt) tokens. A row ends at an EOS token (not included; `eos_ids=()` ignores EOS, as
    --ignore-eos), when `stop(row, tokens)` says so after a token (a stop string: the tokens so far
    are kept), or at its limit. `on_token(row, token)` sees every new token as it is chosen
    (streaming, progress). `row` is the result's index. `cache_core` replaces the cache's attention
    core (models/cache.py); `backend` makes the cache and runs the prefill (LocalGeneration, or
    generate/sharded.py's ShardedGeneration on every rank of a layout, which then all return the
    same results).

    Sampling (generate/sampling.py): prompt i draws from its own stream, seeded `seeds[i]` (default
    derive_seed(sampling.seed, i)), so its tokens do not depend on the other prompts or the batch.
    `num_samples`: N continuations per prompt (sample s seeded sample_seed(seed, s)); the prompt is
    prefilled once and its cache rows copied. `logprobs`: None (off), 0 (each new token's
    log-probability) or N (also the top N (id, log-probability) per position), from the processed
    logits the token was chosen from (sampling.process). Results are prompt-major: prompt 0's samples
    0..N-1, then prompt 1's, ... (transformers' num_return_sequences order)."""
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
            cache = backend.cache(model, n * num_samples, max_len, core=cache_core)
            logits = torch.empty(n, model.cfg.vocab_size, device=device)
            prefill_s = [0.0] * n
            lengths = [len(prompts[i]) for i in order]
            for flat, row, end in prefill_calls(lengths, prefill_chunk, getattr(backend, "flat", False)):
                t0 = time.perf_counter()
                rows = [list(prompts[order[r]]) for r in range(row, end)]
                if flat:
                    logits[row:end] = backend.prefill_flat(model, cache.rows(row, end), rows)
                else:
                    tokens = torch.tensor(rows, dtype=torch.long, device=device)
                    logits[row:end] = backend.prefill(model, cache.rows(row, end), tokens, prefill_chunk)
                seconds = time.perf_counter() - t0
                for r in range(row, end):
                    prefill_s[r] = seconds
            if num_samples > 1:  # row s * n + j: sample s of the j-th shortest prompt
                backend.repeat_rows(cache, n, num_samples)
                logits = logits.repeat(num_samples, 1)
            rows = [_Row(order[j] * num_samples + s, order[j], s, limits[order[j]], prefill_s[j],
                         None if sampling.greedy else sample_seed(seeds[order[j]], s))
                    for s in range(num_samples) for j in range(n)]
            return _decode(model, cache, logits, rows, [prompts[r.prompt] for r in rows], sampling, eos, stop,
                           on_token, logprobs)
    finally:
        model.train(was_training)


@dataclass
class _Row:
    index: int        # the result's index (prompt-major)
    prompt: int
    sample: int
    limit: int
    prefill_s: float
    seed: int | None  # None: greedy


def _decode(model, cache, logits, rows: list[_Row], prompts, sampling, eos, stop, on_token, logprobs) -> list[Result]:
    n = len(rows)
    processors = Processors(sampling, prompts, logits.shape[-1], sorted(eos), logits.device) \
        if sampling.penalised or sampling.min_new_tokens else None
    generators = None if sampling.greedy else row_generators([r.seed for r in rows])
    out: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
    reason: list[str | None] = [None] * n
    decode_s = [0.0] * n
    for r in range(n):
        if rows[r].limit <= 0:
            reason[r] = "length"
    t0 = time.perf_counter()
    while True:
        processed = process(logits, sampling, processors)
        chosen = processed.argmax(dim=-1) if sampling.greedy else draw(processed, generators)
        host = chosen.tolist()  # the one host read per step (two more with logprobs)
        if logprobs is not None:
            lp = torch.log_softmax(processed, dim=-1)
            chosen_lp = lp.gather(-1, chosen[:, None])[:, 0].tolist()
            if logprobs:
                top = torch.topk(lp, min(logprobs, lp.shape[-1]), dim=-1)
                top_ids, top_lp = top.indices.tolist(), top.values.tolist()
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
            if logprobs is not None:
                lps[r].append(chosen_lp[r])
                if logprobs:  # (a token the sampling settings removed, at -inf, is left out)
                    tops[r].append([(i, v) for i, v in zip(top_ids[r], top_lp[r]) if v != float("-inf")])
            if on_token is not None:
                on_token(rows[r].index, token)
            if stop is not None and stop(rows[r].index, out[r]):
                reason[r] = "stop"
            elif len(out[r]) >= rows[r].limit:
                reason[r] = "length"
        if all(x is not None for x in reason):
            break
        if processors is not None:
            processors.chosen(chosen)
        logits = model(chosen[:, None], cache=cache)[:, -1].float()
    results: list[Result | None] = [None] * n
    for r, row in enumerate(rows):
        results[row.index] = Result(len(prompts[r]), out[r], reason[r], row.prefill_s, decode_s[r], row.sample,
                                    row.seed, lps[r] if logprobs is not None else None,
                                    tops[r] if logprobs else None)
    return results
