"""Plain decoding through the compiled step in blocks: up to BLOCK tokens per row per round, with no host
read between them; the decode loop (generate/loop.py) reads a block's tokens once and takes them one by one.

Why: a small model's compiled decode step is a few hundred microseconds of device work, but a host read
per token (the loop's `tolist` for EOS, stop strings and streaming; sampling's finiteness check; a
blocking copy of the step's positions) makes the host wait for the device every token, so the device then
waits for the host's Python and launches. In a block:
- each step's model call, LM head and choice (greedy argmax, or the inverse CDF of the row's uniform) are
  one compiled graph (`next_token`; a CUDA graph on a GPU); its only input from the host is the positions
  (one non-blocking copy, models/cached_attention.py to_device), and its token feeds the next step on the
  device;
- sampling's uniforms for the whole block come from each row's host generator at once (the same stream,
  one float64 per step, as one draw per step gives), and a row whose distribution is not finite is chosen
  as UNCHOSEN and raised at the block's read (sampling.check_chosen), not checked per token;
- with penalties or min_new_tokens (sampling.Processors: state that follows every token) the model call
  alone is compiled (models/static_decode.py) and the processing runs eagerly per step, on the device.
The tokens are those of one step per round: a row takes its block's tokens in order and ends where it
ended (EOS, a stop, its limit); the tokens after that were computed and are ignored, as a finished row's
are in any round. A block never runs past the longest limit, so the cache's room is as before. What
changes: streaming (`on_token`) sees a block's tokens together, and a row that ends inside a block has
the block's time in its decode time. The eager path decodes one token per round (the reference).

A block without processors or logprobs runs as a `BlockGraph`: its steps on static buffers (the rows'
last tokens, their positions at the block's start, the uniforms, the tokens), each step's positions
made on the device from the start (start + j), so nothing of a step comes from the host. On a GPU the
block's steps are then captured as ONE CUDA graph (the second time a block of that size runs on that
cache; the first runs them as they are, compiling and warming up) and every later block is one replay:
the host's Python per step (dynamo's guards, torch.compile's CUDA graph tree's bookkeeping, the glue around
the call; the debug model's step is a few hundred microseconds of that for far less device work) is paid
at the capture, not per token. A cache and its graphs are kept for the next generation of its shape
(generate/cache_pool.py), which then replays from its first block. On a CPU the steps simply run, the same
code. `LONGCTX_DECODE_GRAPHS=0` keeps a GPU to the steps without the block's graph (a fallback, should a
capture fail on some setup)."""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict

import torch

from .. import env_vars
from ..models.static_decode import CompiledStep, model_key, static_hidden_states
from .contracts import Cache, Round
from .sampling import Processors, Sampling, greedy_choice, inverse_cdf, process

BLOCK = 16  # decode steps between host reads: 1/16 of a read per token, at most 15 steps past a row's end


def next_token(model, tokens, positions, k_cache, v_cache, uniforms, sampling: Sampling, keep: bool):
    """One plain decode step with static shapes, compiled whole: each row's last token [b] at its
    `positions` [b, 1] (its slot too) -> (the next tokens [b] long, the processed logits [b, vocab] fp32
    when `keep`, else None). `uniforms` [b] float64 (sampling; None greedy)."""
    among = torch.ones(1, 1, dtype=torch.bool, device=tokens.device)
    tokens = _embeddable(tokens)
    hidden = static_hidden_states(model, tokens[:, None], positions, positions, positions[:, 0], among,
                                  k_cache, v_cache, True)
    processed = process(model.logits(hidden[:, 0]), sampling)
    chosen = greedy_choice(processed) if sampling.greedy else inverse_cdf(processed, uniforms)
    return chosen, (processed if keep else None)


def step_variant(model, cache: Cache, sampling: Sampling, keep: bool) -> tuple:
    """`next_token`'s variant (models/static_decode.py `_compiled`: a code object per variant): the model's, the
    cache's dtype and the branches `process` takes (greedy; else top-k, top-p, min-p each on or off; the logits kept),
    so that a process running several sampling settings keeps each one's graphs off the others' recompile limit.
    The values (temperature, top_k, ...) stay out: a new value compiles once more, dynamic, in its variant."""
    # (greedy reads no filter: a greedy run with a top_k set, which the library takes, shares greedy's graphs)
    on = ("greedy",) if sampling.greedy else (
        0 < sampling.top_k < model.cfg.vocab_size, sampling.top_p < 1.0, sampling.min_p > 0.0)
    return model_key(model), cache.k.dtype, on, keep


def _embeddable(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens fed to the next step: an UNCHOSEN row's (-1: no distribution) as token 0. Its error is raised
    at the block's read (or the row had ended: its tokens are ignored); fed as is, the embedding's lookup
    failed first (a GPU's device-side assert, which leaves the process's CUDA context unusable)."""
    return tokens.clamp(min=0)


def block_size(cache: Cache, steps_left: int) -> int:
    """Steps the next block may take: up to BLOCK and the steps left, each a call the compiled step
    handles (the cache's spare last slot stays free); 0: none (decode one step the usual way)."""
    step = getattr(cache, "fast", None)
    if not isinstance(step, CompiledStep):
        return 0
    room = cache.k.shape[3] - 1 - int(cache.lengths.max())  # (each step appends one token to every row)
    return max(0, min(BLOCK, steps_left, room))


def block_uniforms(generators, steps: int, device) -> torch.Tensor:
    """[steps, rows] float64: each row's next `steps` uniforms from its host generator (one draw of
    `steps` is the stream of `steps` draws of one), step-major so that a step's row is contiguous."""
    values = torch.stack([torch.rand((steps,), dtype=torch.float64, generator=g) for g in generators], dim=1)
    return values if torch.device(device).type == "cpu" else values.pin_memory().to(device, non_blocking=True)


def decode_block(model, cache: Cache, chosen: torch.Tensor, steps: int, sampling: Sampling, generators,
                 processors: Processors | None, keep: bool) -> Round:
    """`steps` decode steps from each row's last token `chosen` [rows], no host read among them: the
    Round of their tokens [rows, steps] (and processed logits [rows, steps, vocab] when `keep`), the
    processors' state following every token (`followed`)."""
    rows, device = chosen.shape[0], chosen.device
    uniforms = None if sampling.greedy else block_uniforms(generators, steps, device)
    if processors is None and not keep:
        return _static_block(model, cache, chosen, steps, sampling, uniforms)
    tokens = torch.empty(steps, rows, dtype=torch.long, device=device)  # step-major: step j's row contiguous
    kept = torch.empty(steps, rows, model.cfg.vocab_size, device=device) if keep else None
    for j in range(steps):
        u = None if uniforms is None else uniforms[j]
        if processors is None:
            token, processed = _fused_step(model, cache, chosen, u, sampling, keep)
        else:
            # (the compiled forward, cache.fast)
            logits = model(_embeddable(chosen)[:, None], cache=cache)[:, -1].float()
            processed = process(logits, sampling, processors)
            token = greedy_choice(processed) if sampling.greedy else inverse_cdf(processed, u)
            processors.chosen(token)
        tokens[j] = token  # (a copy: a CUDA graph's output is overwritten by its next replay)
        if keep:
            kept[j] = processed
        chosen = tokens[j]
    return Round(tokens.T, None if kept is None else kept.transpose(0, 1), followed=processors is not None)


def _fused_step(model, cache: Cache, chosen: torch.Tensor, u, sampling: Sampling, keep: bool):
    """One step through `next_token`, compiled by the cache's step: the cache's bookkeeping as the model's
    cached forward keeps it (begin: the positions; end: the rows hold the token)."""
    step = cache.begin(1, chosen.device)
    ok = False
    try:
        out = cache.fast.launch(next_token, chosen.device, 1, model, chosen, step.positions, cache.k, cache.v, u,
                                sampling, keep, variant=step_variant(model, cache, sampling, keep))
        ok = True
    finally:
        cache.end(ok)
    return out



def _static_block(model, cache: Cache, chosen: torch.Tensor, steps: int, sampling: Sampling, uniforms) -> Round:
    """A block of `steps` plain steps through its BlockGraph (one per cache, compile settings, rows, size and
    sampling); the cache's bookkeeping once for the block (begin: the room and each row's start; end: the rows
    hold them). Keyed by the step's settings, not the step: a cache kept across generations
    (generate/cache_pool.py) replays its graphs for a later generation's own CompiledStep of those settings."""
    # (the run's seed only seeds the host's generators, whose uniforms the block takes as input: not in the graph)
    settings = dataclasses.replace(sampling, seed=0)
    key = (cache.fast.mode, cache.fast.backend, chosen.shape[0], steps, settings)
    block = _graph_for(cache, key, lambda: BlockGraph(model, cache, chosen.shape[0], steps, settings))
    step = cache.begin(steps, chosen.device)
    ok = False
    try:
        tokens = block.run(chosen, step.positions[:, 0], uniforms)
        ok = True
    finally:
        cache.end(ok)
    return Round(tokens.T, None, followed=False)


# each cache's block graphs (they hold the addresses of its keys and values), least recently run first: gone with
# the cache
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# block graphs kept per cache, the least recently run dropped first. Each captured one holds a private pool of
# device memory (its steps' intermediates: a few [rows, vocab] fp32 logits), and a cache is kept across
# generations (generate/cache_pool.py: up to 4 per model), so without a bound every sampling setting and every
# last partial block size a process ever ran would stay. A generation runs at most two sizes (BLOCK, then its
# last partial block), so 4 keeps the full and partial blocks of two settings in turn (greedy and a sampled one;
# or one setting's BLOCK and its last three partial sizes); past that a dropped key costs one uncaptured run
# and a capture again, the cost of a new cache, never a wrong token.
GRAPHS_PER_CACHE = 4


def _graph_for(cache: Cache, key: tuple, make) -> BlockGraph:
    """The cache's BlockGraph of `key` (made by `make()` when it has none), now its most recently run; the
    least recently run dropped past GRAPHS_PER_CACHE."""
    graphs = _GRAPHS.setdefault(cache, OrderedDict())
    block = graphs.pop(key, None)
    graphs[key] = block = block if block is not None else make()
    while len(graphs) > GRAPHS_PER_CACHE:
        graphs.popitem(last=False)
    return block


class BlockGraph:
    """`steps` plain decode steps of `rows` rows on `cache` (`next_token`, through the cache's compiled step)
    on static buffers: `run` copies a block's inputs in, runs the steps (on a GPU from the second run one
    CUDA graph's replay, `capture_for`), and returns the tokens [steps, rows] (a copy)."""

    def __init__(self, model, cache: Cache, rows: int, steps: int, sampling: Sampling):
        device = cache.k.device
        # (both weakly: a cache kept across generations holds its graphs, and generate/cache_pool.py's pool keeps
        # it only while the model lives: a strong reference here would keep the model, and so the pool entry, alive)
        self.model, self.cache, self.steps, self.sampling = weakref.ref(model), weakref.proxy(cache), steps, sampling
        self.chosen = torch.zeros(rows, dtype=torch.long, device=device)  # the rows' last tokens
        self.start = torch.zeros(rows, dtype=torch.long, device=device)   # their positions at the block's start
        self.uniforms = None if sampling.greedy else torch.zeros(steps, rows, dtype=torch.float64, device=device)
        self.tokens = torch.empty(steps, rows, dtype=torch.long, device=device)  # step-major
        self.capture = capture_for(device)
        self.graph = None
        self.copy = None  # the compiled copy a captured graph replays (models/compiled_copies.py)
        self.runs = 0

    def run(self, chosen: torch.Tensor, start: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        self.chosen.copy_(chosen)
        self.start.copy_(start)
        if uniforms is not None:
            self.uniforms.copy_(uniforms)
        if self.graph is None and self.capture is not None and self.runs:  # (compiled and warm: the first ran)
            calls = self.cache.fast.calls
            self.graph = self.capture(self.steps_)
            self.cache.fast.calls = calls  # (a capture records the steps; the replay below runs them)
            # the replay launches that copy's kernels: held while the graph is, whatever the copies' bound drops
            self.copy = self.cache.fast.copy(next_token, chosen.device, 1, True,
                                             step_variant(self.model(), self.cache, self.sampling, False))
        if self.graph is not None:
            self.graph.replay()
            self.cache.fast.calls += self.steps
        else:
            self.steps_()
        self.runs += 1
        return self.tokens.clone()  # (the buffer is the next run's)

    def steps_(self) -> None:
        """The block's steps on the buffers: step j's positions are the start + j, its token the next's input."""
        cache, chosen, model = self.cache, self.chosen, self.model()
        variant = step_variant(model, cache, self.sampling, False)
        for j in range(self.steps):
            positions = (self.start + j)[:, None]
            u = None if self.uniforms is None else self.uniforms[j]
            token, _ = cache.fast.launch(next_token, chosen.device, 1, model, chosen, positions, cache.k,
                                         cache.v, u, self.sampling, False, graphed_by_caller=self.capture is not None,
                                         variant=variant)
            self.tokens[j] = token
            chosen = self.tokens[j]


def capture_for(device: torch.device):
    """How a BlockGraph on `device` captures its steps: on a GPU as a CUDA graph (`_cuda_graph`; unless
    LONGCTX_DECODE_GRAPHS=0), elsewhere not at all (None: the steps run each time)."""
    graphs = env_vars.switch(env_vars.DECODE_GRAPHS_ENV)  # (read on any device: 1 or 0, as on a GPU)
    if torch.device(device).type != "cuda" or not graphs:
        return None
    return _cuda_graph


def _cuda_graph(steps):
    """`steps()` captured as one CUDA graph (recorded, not run: the caller replays it). Its kernels were
    compiled and run once before, outside any capture (torch.cuda.graph's warm-up rule)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    return graph
