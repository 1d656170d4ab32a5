"""The one decode loop of generate/: prefill, then rounds until every row has ended; each row's Result.

Plain decoding (generate/engine.py), a speculative chain and CaPE's tree (generate/speculative.py)
all run here. They differ only in their `Rounds` (generate/contracts.py): how a round chooses its
tokens (one per row from the last logits; or a draft's proposals verified in one target call, the
kept ones and the target's token after them). The loop owns everything else:
- prefill: prompts ordered by length, so that each prefill call fills a contiguous range of cache
  rows (a view, no copy). Short prompts of different lengths share one flat call where the backend
  can (`FlatPrefill`: concatenated, positions restarting and attention masked per prompt), up to
  `prefill_chunk` tokens per call; a longer prompt, with those of its length, is prefilled in chunks
  of `prefill_chunk` tokens, so nothing is [S, S]. No padding is ever computed in prefill. A prompt's
  `num_samples` rows share its prefill (the rows copied).
- rounds: a row takes its round's tokens one by one: an EOS ends it (not kept), else the token is
  kept (its logprobs; `on_token`), then a stop (`stop(row, tokens)`) or its limit ends it. A row that
  has ended ignores the later rounds' tokens (plain decoding keeps feeding it, masked: its keys are
  only ever seen by itself) until every row has ended.
- the penalties' state (sampling.Processors) follows every token a round gives, for the next round;
  the logprobs are those of the processed logits each token was chosen from.
- bookkeeping: per row its tokens, finish reason, decode time (until its last token) and, speculating,
  the proposals each round kept and made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..models.moe_eval_routing import dropless
from ..models.static_decode import CompiledStep, install
from .contracts import Backend, Cache, FlatPrefill, LeasedCaches, Round, Rounds
from .loading import check_window
from .results import Result
from .sampling import Processors, Sampling, check_chosen, sample_seed


@dataclass
class Row:
    """One row of the cache: a request (a prompt, or one of its samples)."""

    index: int        # the result's index (prompt-major)
    prompt: int       # which prompt
    sample: int
    limit: int        # new tokens at most
    prefill_s: float
    seed: int | None  # None: greedy


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


def decode(model, prompts: Sequence[Sequence[int]], rounds: Rounds, *, limits: Sequence[int],
           seeds: Sequence[int], sampling: Sampling, backend: Backend, num_samples: int = 1,
           eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
           stop: Callable[[int, list[int]], bool] | None = None, on_token: Callable[[int, int], None] | None = None,
           cache_core=None, device: torch.device | None = None, logprobs: int | None = None,
           compiled: CompiledStep | None = None) -> list[Result]:
    """Continue each prompt by up to its limit of new tokens, `rounds` choosing them; `num_samples`
    rows per prompt (sample s of prompt i seeded sample_seed(seeds[i], s)). Results prompt-major:
    prompt 0's samples 0..N-1, then prompt 1's, ... `logprobs`: None (off), 0 (each token's) or N
    (also the top N (id, log-probability) per token). `compiled`: after the prefill, the rounds'
    model calls run through this compiled static-shape step (models/static_decode.py) where the cache
    and model have one (one device, a dense model; else eagerly, as without it)."""
    n = len(prompts)
    # (a list of another length was cut or ran out of rows silently; a negative limit sized the cache below
    # the prompt, an error about max_len that named nothing the caller gave)
    if len(limits) != n or any(int(limit) < 0 for limit in limits):
        raise ValueError(f"max_new_tokens must be one int >= 0 for every prompt, or a list of one per prompt; got "
                         f"{list(limits)} for {n} prompt{'s' * (n != 1)}")
    _check_ids(prompts, model.cfg.vocab_size)
    _check_window(model, prompts, limits, backend)
    device = device or model.tok_embeddings.weight.device
    # cache rows in order of length, so each length group is a contiguous range of rows
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    # a finished row is fed until every row is done, so each row may take the largest limit of steps
    # (+ 1: the compiled step's spare slot, where the padding of a bucket writes)
    max_len = max(len(p) for p in prompts) + max(limits) + rounds.room + (compiled is not None)
    batch = n * num_samples
    with generating(model), torch.inference_mode(), _cache(backend, model, batch, max_len, cache_core) as cache:
        logits, prefill_s = _prefill(model, backend, cache, [prompts[i] for i in order], prefill_chunk, device)
        if num_samples > 1:  # row s * n + j: sample s of the j-th shortest prompt
            backend.repeat_rows(cache, n, num_samples)
            logits = logits.repeat(num_samples, 1)
        if compiled is not None:  # (the prefill stays eager: its chunks are compute, and each length a graph)
            install(cache, model, compiled)
        rows = [Row(order[j] * num_samples + s, order[j], s, limits[order[j]], prefill_s[j],
                    None if sampling.greedy else sample_seed(seeds[order[j]], s))
                for s in range(num_samples) for j in range(n)]
        book = _Book(rows, [prompts[r.prompt] for r in rows], {int(e) for e in eos_ids}, stop, on_token, logprobs,
                     "the greedy choice's" if sampling.greedy else "the sampled distribution's")
        return _run(rounds, cache, logits, book, sampling)


@contextmanager
def _cache(backend: Backend, model, batch: int, max_len: int, core):
    """The generation's cache, made on entering (under inference mode): leased where the backend keeps caches
    across generations (the compiled step's graphs on it then serve the next one: generate/cache_pool.py),
    else made for it."""
    if isinstance(backend, LeasedCaches):
        with backend.lease(model, batch, max_len, core=core) as cache:
            yield cache
    else:
        yield backend.cache(model, batch, max_len, core=core)


def _check_ids(prompts: Sequence[Sequence[int]], vocab: int) -> None:
    """Every prompt id within the model's vocabulary, before any work: else the embedding's lookup fails inside
    the prefill (a CPU's "index out of range in self", naming no prompt; a GPU's device-side assert, after
    which the process's CUDA context is unusable). The command checks its prompts earlier (prompts.py)."""
    for i, prompt in enumerate(prompts):
        if not len(prompt):  # (the entry points refuse an empty prompt by name)
            continue
        if isinstance(prompt, torch.Tensor):  # (min() over a tensor would step through 0-d tensors)
            low, high = int(prompt.min()), int(prompt.max())
        else:
            low, high = int(min(prompt)), int(max(prompt))  # (C loops: a 128K-token prompt in milliseconds)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"prompt {i} has token id {bad}, outside the model's vocabulary of {vocab} ids "
                             f"(0..{vocab - 1})")


def _check_window(model, prompts: Sequence[Sequence[int]], limits: Sequence[int], backend: Backend) -> None:
    """Every entry point's sliding-window rule (generate/loading.py check_window), before any work: the longest
    prompt + limit within the window of the model's weights, else an error. Under InfLLM's context memory (a
    backend with a `shape`, models/context_memory.py InfLLMShape) no query sees a distance past its
    `positions_needed` - 1, whatever the length: that span is what meets the window (its placement's:
    `ordered` lays the retrieved units out before the window, past `shared`'s one distance `far`)."""
    longest = max(len(p) + int(limit) for p, limit in zip(prompts, limits))
    needed = getattr(getattr(backend, "shape", None), "positions_needed", None)
    check_window(model.cfg, longest if needed is None else min(longest, needed), "generate")


@contextmanager
def generating(model):
    """`model` (None: nothing) as generation runs it, a target or a draft: in eval mode (a train-mode
    Sinkhorn router would route by its balanced assignment) and dropless (models/moe_eval_routing.py: a MoE capacity
    would make a row's tokens depend on the rows and calls it runs with); its mode back after."""
    if model is None:
        yield
        return
    was_training = model.training
    model.eval()
    try:
        with dropless(model):
            yield
    finally:
        model.train(was_training)


def _prefill(model, backend: Backend, cache: Cache, prompts, chunk: int, device) -> tuple[torch.Tensor, list[float]]:
    """`prompts` (ascending lengths) into cache rows 0.. in order: each one's last logits [n, vocab]
    (fp32) and the seconds of the call it took part in."""
    logits = torch.empty(len(prompts), model.cfg.vocab_size, device=device)
    seconds = [0.0] * len(prompts)
    for flat, row, end in prefill_calls([len(p) for p in prompts], chunk, isinstance(backend, FlatPrefill)):
        t0 = time.perf_counter()
        rows = [list(p) for p in prompts[row:end]]
        if flat:
            logits[row:end] = backend.prefill_flat(model, cache.rows(row, end), rows)
        else:
            tokens = torch.tensor(rows, dtype=torch.long, device=device)
            logits[row:end] = backend.prefill(model, cache.rows(row, end), tokens, chunk)
        if logits.device.type == "cuda":  # the call's kernels done before the clock is read (else: launch time,
            torch.cuda.synchronize(logits.device)  # and the decode's clock absorbed the rest of the prefill)
        seconds[row:end] = [time.perf_counter() - t0] * (end - row)
    return logits, seconds


def _run(rounds: Rounds, cache: Cache, logits: torch.Tensor, book: _Book, sampling: Sampling) -> list[Result]:
    """Rounds until every row has ended."""
    processors = Processors(sampling, book.prompts, logits.shape[-1], sorted(book.eos), logits.device) \
        if sampling.penalised or sampling.min_new_tokens else None
    t0 = time.perf_counter()
    taken = rounds.first(cache, logits, book.prompts, [r.seed for r in book.rows], processors)
    while not book.take(taken, t0):
        if processors is not None and not taken.followed:
            for j in range(taken.tokens.shape[1]):
                processors.chosen(taken.tokens[:, j])
        taken = rounds.next(cache, processors)
    return book.results()


class _Book:
    """What each row has got so far: tokens, logprobs, finish reason, decode time, proposals."""

    def __init__(self, rows: list[Row], prompts, eos: set[int], stop, on_token, logprobs: int | None,
                 choice: str = "the greedy choice's"):
        n = len(rows)
        self.rows, self.prompts, self.eos, self.stop, self.on_token = rows, prompts, eos, stop, on_token
        self.choice = choice  # what chose the tokens: an UNCHOSEN token's error names it
        self.logprobs = logprobs
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        self.reason: list[str | None] = ["length" if r.limit <= 0 else None for r in rows]
        self.decode_s = [0.0] * n
        self.accepted: list[list[int]] = [[] for _ in range(n)]
        self.proposed: list[list[int]] = [[] for _ in range(n)]
        self.unused = [0] * n

    def take(self, taken: Round, t0: float) -> bool:
        """Each live row takes its tokens of the round; whether every row has now ended."""
        host = taken.tokens.tolist()  # the one host read per round (two more with logprobs)
        chosen_lp, tops = _logprobs(taken, self.logprobs) if self.logprobs is not None else (None, None)
        elapsed = time.perf_counter() - t0
        for r in range(len(self.rows)):
            if self.reason[r] is not None:
                continue
            self.decode_s[r] = elapsed
            if taken.kept is not None:
                self.accepted[r].append(taken.kept[r])
                self.proposed[r].append(taken.proposed[r])
            for j, token in enumerate(host[r]):
                if self._token(r, token, None if chosen_lp is None else chosen_lp[r][j],
                               None if tops is None else tops[r][j]):
                    # the row ended on its round's token j (EOS, a stop, its limit): the kept proposals after it
                    # were verified but not emitted, so tau (tokens per pass) leaves them out
                    if taken.kept is not None:
                        self.unused[r] = max(0, taken.kept[r] - j)
                    break
        return all(x is not None for x in self.reason)

    def _token(self, r: int, token: int, logprob: float | None, top) -> bool:
        """Row r takes `token`; whether the row has ended."""
        check_chosen(token, self.choice)
        if token in self.eos:
            self.reason[r] = "eos"
            return True
        row, out = self.rows[r], self.tokens[r]
        out.append(token)
        if logprob is not None:
            self.lps[r].append(logprob)
        if top is not None:
            self.tops[r].append(top)
        if self.on_token is not None:
            self.on_token(row.index, token)
        if self.stop is not None and self.stop(row.index, out):
            self.reason[r] = "stop"
        elif len(out) >= row.limit:
            self.reason[r] = "length"
        return self.reason[r] is not None

    def results(self) -> list[Result]:
        results: list[Result | None] = [None] * len(self.rows)
        for r, row in enumerate(self.rows):
            results[row.index] = Result(
                len(self.prompts[r]), self.tokens[r], self.reason[r], row.prefill_s, self.decode_s[r], row.sample,
                row.seed, self.lps[r] if self.logprobs is not None else None, self.tops[r] if self.logprobs else None,
                self.accepted[r], self.proposed[r], self.unused[r])
        return results


def _logprobs(taken: Round, top: int):
    """Per row and token: its log-probability under the processed logits it was chosen from, and
    (top > 0) the `top` most likely (id, log-probability), those at -inf (removed by the sampling
    settings) left out."""
    lp = torch.log_softmax(taken.processed, dim=-1)
    chosen = lp.gather(-1, taken.tokens[..., None].to(lp.device))[..., 0].tolist()
    if not top:
        return chosen, None
    best = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    tops = [[[(i, v) for i, v in zip(ids, values) if v != float("-inf")] for ids, values in zip(row_ids, row_values)]
            for row_ids, row_values in zip(best.indices.tolist(), best.values.tolist())]
    return chosen, tops
