"""Caches kept across generations (generate/cache_pool.py), held to what a fresh cache per generation gave:
- a second generation of a shape replays every block of its BlockGraph (no capture: one over both, was two),
  with the eager path's tokens (the stand-in capture of test_block_graph.py: a CPU has no CUDA graph);
- the same results with and without reuse (LONGCTX_REUSE_CACHES=0), over generations one after another of
  other prompt lengths and rows: greedy and seeded sampling, eager and compiled, EOS and a stop string,
  logprobs, penalties;
- a cache in use is never handed out (a generation started inside another's on_token: its own cache);
- a reused cache is as new: empty, no compiled step, zeroed (non-finite leftovers would poison its masks);
- not kept: after an error, for a custom core, for replaced weights, past the pool's bounds, once the model
  is gone (the pool keeps no model alive)."""

import gc
import weakref

import pytest
import torch
from test_block_graph import StandIn
from test_decode_blocks import Counted

import longctx.generate.blocks as blocks
from longctx.config import load_config
from longctx.generate.blocks import BLOCK
from longctx.generate.cache_pool import POOL, CachePool, capacity
from longctx.generate.engine import generate
from longctx.generate.local import LOCAL
from longctx.generate.sampling import Sampling
from longctx.models.kv_cache import attend
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    POOL.clear()
    yield
    POOL.clear()
    torch._dynamo.reset()


class Tracked(StandIn):
    """The stand-in capture, each instance listed (their replays counted per generation)."""

    made: list = []

    def __init__(self, steps):
        super().__init__(steps)
        Tracked.made.append(self)


@pytest.fixture
def tracked(monkeypatch):
    StandIn.captures, Tracked.made = 0, []
    monkeypatch.setattr(blocks, "capture_for", lambda device: Tracked)
    return Tracked


def _model(seed=1):
    cfg = load_config(overrides=["--model.preset=debug", "--model.layers=2"]).model
    return build_model(cfg, seed=seed).eval()


def _prompt(n, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _replays() -> int:
    return sum(g.replays for g in Tracked.made)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=50, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_second_generation_replays_every_block_and_captures_nothing(tracked, sampling):
    model, step = _model(), Counted()
    new = 3 * BLOCK + 1  # 48 decode steps: three full blocks, no partial one
    eager = generate(model, [_prompt(37)], max_new_tokens=new, sampling=sampling)[0].tokens
    first = generate(model, [_prompt(37)], max_new_tokens=new, sampling=sampling, compile=step)[0].tokens
    # the first block runs as it is, the second is captured and replayed, the third replayed
    assert first == eager and tracked.captures == 1 and _replays() == 2
    # another prompt length, its own seed, a new CompiledStep of the same settings: the same cache and graph
    other = _prompt(50, seed=3)
    resampled = Sampling(temperature=0.9, top_k=50, seed=6) if not sampling.greedy else sampling
    same_settings = CompiledStep(backend=step.counter)
    again = generate(model, [other], max_new_tokens=new, sampling=resampled, compile=same_settings)[0].tokens
    assert tracked.captures == 1 and _replays() == 2 + 3  # every block of the second generation a replay
    assert again == generate(model, [other], max_new_tokens=new, sampling=resampled)[0].tokens


def _requests(eos: int):
    """Generations one after another: other prompt lengths, one row and several, greedy and seeded sampling,
    EOS, a stop, logprobs and penalties; each eager and compiled."""
    sampled = Sampling(temperature=0.8, top_p=0.9, seed=3)
    penalised = Sampling(temperature=0.7, seed=2, repetition_penalty=1.3, presence_penalty=0.3, min_new_tokens=5)
    out = []
    for compile in (False, True):
        out += [
            dict(prompts=[_prompt(20, 1)], max_new_tokens=40, compile=compile),
            dict(prompts=[_prompt(61, 2)], max_new_tokens=40, compile=compile),
            dict(prompts=[_prompt(9, 3), _prompt(33, 4), _prompt(15, 9)], max_new_tokens=[35, 20, 30],
                 eos_ids=[eos], stop=lambda row, tokens: row == 1 and len(tokens) >= 7, compile=compile),
            dict(prompts=[_prompt(40, 5)], max_new_tokens=33, sampling=sampled, compile=compile),
            dict(prompts=[_prompt(12, 6), _prompt(30, 7)], max_new_tokens=[21, 35], sampling=sampled,
                 num_samples=2, logprobs=2, compile=compile),
            dict(prompts=[_prompt(20, 8)], max_new_tokens=30, sampling=penalised, compile=compile),
            dict(prompts=[_prompt(26, 1)], max_new_tokens=40, compile=compile),
        ]
    return out


def _run_all(model, eos: int) -> list:
    results = []
    # one compiled step for the pass's compiled requests, as a process's generations share the one compile of
    # the "inductor" backend (static_decode._compiled): a new counting backend per request traced every
    # bucket again for each of the seven (~7x the tracing, no other difference)
    step = Counted()
    for request in _requests(eos):
        request = dict(request)
        compile = step if request.pop("compile") else False
        for r in generate(model, request.pop("prompts"), compile=compile, **request):
            results.append((r.tokens, r.finish_reason, r.logprobs, r.top_logprobs, r.sample, r.seed))
    return results


def test_the_same_results_with_and_without_reuse(monkeypatch):
    model = _model()
    eos = generate(model, [_prompt(15, seed=9)], max_new_tokens=30)[0].tokens[11]  # (inside the third request)
    count = len(_requests(eos))
    POOL.clear()
    monkeypatch.setenv("LONGCTX_REUSE_CACHES", "0")
    made = POOL.made
    without = _run_all(model, eos)
    assert POOL.made - made == count and not POOL.held(model)
    monkeypatch.setenv("LONGCTX_REUSE_CACHES", "1")
    made = POOL.made
    with_reuse = _run_all(model, eos)
    assert POOL.made - made < count - 4  # (caches were reused: the shapes repeat)
    assert with_reuse == without
    assert any(reason == "eos" for _, reason, *_ in without) and any(r == "stop" for _, r, *_ in without)


def test_a_cache_in_use_is_never_handed_out():
    """A generation started inside another (its on_token) leases its own cache of the same shape, and both
    give the tokens each gives alone."""
    model = _model()
    outer_prompt, inner_prompt = _prompt(20, 1), _prompt(21, 2)  # (one shape: the same capacity and rows)
    alone_outer = generate(model, [outer_prompt], max_new_tokens=20)[0].tokens
    alone_inner = generate(model, [inner_prompt], max_new_tokens=20)[0].tokens
    inner = []

    def on_token(row, token):
        if not inner:
            inner.append(generate(model, [inner_prompt], max_new_tokens=20)[0].tokens)

    outer = generate(model, [outer_prompt], max_new_tokens=20, on_token=on_token)[0].tokens
    assert outer == alone_outer and inner == [alone_inner]
    with LOCAL.lease(model, 1, 40) as a, LOCAL.lease(model, 1, 40) as b:
        assert a is not b
    assert len(POOL.held(model)) == 1  # one kept per shape


def test_a_reused_cache_is_empty_uncompiled_and_zeroed():
    model, step = _model(), Counted()
    prompt = _prompt(30, 4)
    fresh = generate(model, [prompt], max_new_tokens=24, compile=step)[0].tokens
    (kept,) = POOL.held(model)
    assert kept.fast is step and int(kept.lengths[0]) > 0
    with torch.inference_mode():  # what a previous generation may have left in slots past every row's length
        kept.k.fill_(float("nan"))
        kept.v.fill_(float("inf"))
    assert generate(model, [prompt], max_new_tokens=24, compile=Counted())[0].tokens == fresh
    (again,) = POOL.held(model)
    assert again is kept
    with LOCAL.lease(model, 1, kept.max_len) as cache:  # an eager generation's: no compiled step inherited
        assert cache is kept and cache.fast is None and not cache.lengths.any() and not cache.k.any()


def test_not_kept_after_an_error_or_with_its_own_core():
    model = _model()
    with pytest.raises(RuntimeError, match="boom"), LOCAL.lease(model, 1, 40):
        raise RuntimeError("boom")
    assert not POOL.held(model)
    with LOCAL.lease(model, 1, 40, core=attend):
        pass
    assert not POOL.held(model)


def test_replaced_weights_get_a_new_cache():
    """A graph captured on the cache read the weights where they were: a model whose parameters were replaced
    (a reload, `.to()`) must not replay it."""
    model = _model()
    with LOCAL.lease(model, 1, 40) as first:
        pass
    with LOCAL.lease(model, 1, 40) as same:
        assert same is first
    model.tok_embeddings.weight = torch.nn.Parameter(model.tok_embeddings.weight.detach().clone())
    with LOCAL.lease(model, 1, 40) as other:
        assert other is not first


def test_the_pool_is_bounded_per_model():
    model, pool = _model(), CachePool(most=2)
    for length in (100, 300, 600):  # three capacities: 256, 512, 768
        with pool.lease(model, 1, length):
            pass
    assert [c.max_len for c in pool.held(model)] == [512, 768]  # the least recently used dropped
    with pool.lease(model, 1, 300):  # 512's used again: 768 is now the oldest
        pass
    with pool.lease(model, 2, 100):
        pass
    assert sorted((c.batch, c.max_len) for c in pool.held(model)) == [(1, 512), (2, 256)]
    small = CachePool(pool_bytes=1)  # a cache larger than the budget is not kept, nor rounded up: no slot unused
    with small.lease(model, 1, 100) as cache:
        assert cache.max_len == 100
    assert not small.held(model)


def test_the_pool_keeps_no_model_alive(tracked):
    model = _model()
    generate(model, [_prompt(20)], max_new_tokens=2 * BLOCK + 1, compile=Counted())  # a block graph on the cache
    assert POOL.held(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_the_capacity_rounds_up_by_at_most_an_eighth_past_256():
    assert capacity(1) == 256 and capacity(256) == 256 and capacity(257) == 512
    assert capacity(1024 + 256 + 1) == 1536  # the bench's compiled request: prompt + new tokens + spare slot
    for n in (2047, 4097, 100_000, 131_073):
        assert n <= capacity(n) < n * 1.125 + 256
    assert len({capacity(n) for n in range(20_000, 21_000)}) <= 2  # nearby lengths share
