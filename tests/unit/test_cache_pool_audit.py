"""An audit of the caches kept across generations (generate/cache_pool.py), for a wrong token or a stale state:
- a cache's block graphs are bounded (blocks.GRAPHS_PER_CACHE, least recently run dropped): each captured one
  holds a private pool of device memory, and a kept cache outlives its generation;
- a speculative draft's cache (ModelDrafter's) is leased from the pool too, the same tokens with and without
  reuse (greedy and seeded sampling, chain and CaPE tree), and no drafter holds a pooled cache after its
  generation (a GliDe drafter the target's, a plain one its own);
- the key a cache is kept under holds what a captured graph read: the weights' devices as well as their
  addresses, and the RoPE attention scale (a constant in the graph);
- what is safe, held so: weights changed in place between generations (train, then generate) are read anew;
  `model.to(dtype)` and back; another model at the freed one's addresses; an error mid-generation (the cache
  is dropped, not kept dirty, and freed); backends whose caches hold other state (sharded, InfLLM) lease none;
  and, with a stand-in that freezes what a CUDA graph freezes, no graph ever replays on other addresses or
  constants across those changes.
On a CPU a block graph is not captured: test_block_graph.py's stand-in records its steps and replays them."""

import dataclasses
import gc
import weakref
from contextlib import contextmanager

import pytest
import torch
from test_block_graph import StandIn
from test_decode_blocks import Counted
from test_decode_cache_reuse import _fresh  # noqa: F401  (autouse: a cleared pool and dynamo around each test)

import longctx.generate.blocks as blocks
from longctx.config import load_config
from longctx.generate.blocks import BLOCK, GRAPHS_PER_CACHE
from longctx.generate.cache_pool import POOL, CachePool, weights_key
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.contracts import LeasedCaches
from longctx.generate.drafters import GlideDrafter, ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.local import LOCAL
from longctx.generate.sampling import Sampling
from longctx.generate.sharded import ShardedGeneration
from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
from longctx.generate.speculative import speculative_generate
from longctx.models.glide import GlideDraft
from longctx.models.llama import build_model


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.captures = 0
    monkeypatch.setattr(blocks, "capture_for", lambda device: StandIn)
    return StandIn


def _model(seed=1, layers=2):
    cfg = load_config(overrides=["--model.preset=debug", f"--model.layers={layers}"]).model
    return build_model(cfg, seed=seed).eval()


def _prompt(n, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sampled(i: int) -> Sampling:
    return Sampling(temperature=0.5 + 0.1 * i, top_k=50, seed=i)


def test_a_caches_block_graphs_are_bounded_least_recently_run_dropped(stand_in):
    """Six sampling settings in turn on one kept cache: GRAPHS_PER_CACHE graphs kept, the last run's; a kept
    setting's next generation replays (no capture), a dropped one's captures again; the tokens always eager's."""
    model, prompt, new = _model(), _prompt(30), 2 * BLOCK + 1  # (two full blocks: one run, one captured)
    settings = [_sampled(i) for i in range(6)]
    step = Counted()  # (one step's settings throughout: a graph is keyed by its compile backend too)
    for s in settings:
        got = generate(model, [prompt], max_new_tokens=new, sampling=s, compile=step)[0].tokens
        assert got == generate(model, [prompt], max_new_tokens=new, sampling=s)[0].tokens
    (cache,) = POOL.held(model)
    graphs = blocks._GRAPHS[cache]
    assert len(graphs) == GRAPHS_PER_CACHE == 4  # (was one per setting ever run: 6)
    assert [key[-1] for key in graphs] == [dataclass_seedless(s) for s in settings[-4:]]
    captures = stand_in.captures
    generate(model, [prompt], max_new_tokens=new, sampling=settings[2], compile=step)  # kept: replayed only
    assert stand_in.captures == captures and list(graphs)[-1][-1] == dataclass_seedless(settings[2])
    again = generate(model, [prompt], max_new_tokens=new, sampling=settings[0], compile=step)[0].tokens
    assert stand_in.captures == captures + 1  # dropped: run once and captured again, the same tokens
    assert again == generate(model, [prompt], max_new_tokens=new, sampling=settings[0])[0].tokens
    assert len(graphs) == GRAPHS_PER_CACHE


def dataclass_seedless(s: Sampling) -> Sampling:
    """A graph's key holds the sampling settings without the seed (its uniforms are an input)."""
    return dataclasses.replace(s, seed=0)


def test_weights_changed_in_place_are_read_anew(stand_in):
    """Train, then generate, in one process: an optimizer's in-place step keeps every address, so the cache and
    its graphs are kept, and the replayed blocks read the new weights (a fresh model of those weights' tokens)."""
    model, prompt, new = _model(), _prompt(25), 3 * BLOCK + 1
    step = Counted()
    before = generate(model, [prompt], max_new_tokens=new, compile=step)[0].tokens
    (cache,) = POOL.held(model)
    with torch.no_grad():  # (a step of SGD on a made-up gradient)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    captures = stand_in.captures
    after = generate(model, [prompt], max_new_tokens=new, compile=step)[0].tokens
    assert POOL.held(model) == [cache] and stand_in.captures == captures  # replayed on the kept cache
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    assert after == generate(fresh, [prompt], max_new_tokens=new)[0].tokens != before


def test_another_dtype_and_back_and_another_model_at_freed_addresses(stand_in):
    model, prompt, new = _model(), _prompt(21), 2 * BLOCK + 3
    want = generate(_model(), [prompt], max_new_tokens=new)[0].tokens
    assert generate(model, [prompt], max_new_tokens=new, compile=Counted())[0].tokens == want
    model.double()
    generate(model, [prompt], max_new_tokens=new)
    assert [c.k.dtype for c in POOL.held(model)] == [torch.float64]  # (the fp32 cache dropped: other weights)
    model.float()  # (its weights may come back at the addresses they had: they are those weights again)
    assert generate(model, [prompt], max_new_tokens=new, compile=Counted())[0].tokens == want
    del model
    gc.collect()  # another model, likely where the first one's weights were: none of its caches
    other = _model(seed=2)
    assert not POOL.held(other)
    assert generate(other, [prompt], max_new_tokens=new, compile=Counted())[0].tokens == \
        generate(_model(seed=2), [prompt], max_new_tokens=new)[0].tokens


def test_the_key_holds_the_weights_devices_and_the_rope_scale():
    """A captured graph holds the RoPE attention scale as a constant and the weights' addresses on their
    device: another scale, or one address on another device, is another key (a new cache)."""
    model = _model()
    key = weights_key(model)
    model.rope_scale = model.rope_scale * 1.1
    assert weights_key(model) != key
    with LOCAL.lease(model, 1, 40) as first:
        pass
    model.rope_scale = 1.3
    with LOCAL.lease(model, 1, 40) as second:
        assert second is not first
    assert all(isinstance(part, tuple) and part[0] == torch.device("cpu") for part in weights_key(model)[1])


def test_an_error_mid_generation_drops_the_cache_and_frees_it(stand_in, monkeypatch):
    model, prompt, new = _model(), _prompt(30), 3 * BLOCK + 1
    leased = []
    real = CachePool.lease

    @contextmanager
    def recording(pool, *args, **kwargs):
        with real(pool, *args, **kwargs) as cache:
            leased.append(weakref.ref(cache))
            yield cache

    monkeypatch.setattr(CachePool, "lease", recording)
    want = generate(model, [prompt], max_new_tokens=new, compile=Counted())[0].tokens  # a kept cache, graphs on it

    def fail(row, token):
        if fail.seen == 2 * BLOCK:  # (after a replayed block: the cache's graphs have run)
            raise KeyboardInterrupt
        fail.seen += 1
    fail.seen = 0
    with pytest.raises(KeyboardInterrupt):
        generate(model, [prompt], max_new_tokens=new, compile=Counted(), on_token=fail)
    assert leased[1]() is leased[0]()  # (the kept one was leased)
    assert not POOL.held(model)  # dropped, not kept dirty
    gc.collect()
    assert leased[1]() is None  # and freed, its graphs with it
    assert generate(model, [prompt], max_new_tokens=new, compile=Counted())[0].tokens == want


def test_backends_whose_caches_hold_other_state_lease_none():
    """A sharded cache (a rank's share, its own core) and InfLLM's (a memory of the generation) are made per
    generation: the loop leases only from a LeasedCaches backend."""
    for backend in (ShardedGeneration, InfLLMGeneration, ShardedInfLLMGeneration):
        assert not isinstance(object.__new__(backend), LeasedCaches), backend
    assert isinstance(LOCAL, LeasedCaches)


def _spec_models():
    target = _model(seed=1, layers=2)
    draft = _model(seed=3, layers=1)
    return target, draft


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_drafts_cache_is_leased_and_the_tokens_are_the_same_without_reuse(monkeypatch, compile):
    from longctx.generate.cape import CapeTable

    target, draft = _spec_models()
    table = CapeTable.parse("0.5:4,0.8:2,1:1")
    runs = [(Sampling(), None), (Sampling(), table), (Sampling(temperature=0.8, top_p=0.9, seed=4), None)]

    def all_runs():
        out = []
        # one compiled step for the pass's runs, as a process's generations share the one compile of the
        # "inductor" backend (models/compiled_copies.py): a new counting backend per run traced every bucket
        # of both models again in each of the six runs (~6x the tracing, no other difference)
        step = Counted() if compile else False
        for prompt in (_prompt(20, 1), _prompt(23, 2)):  # (one capacity: the second reuses the first's caches)
            for sampling, cape in runs:
                drafter = ModelDrafter(draft, len(prompt) + 30 + 4 + 2, compile=step)
                r = speculative_generate(target, drafter, prompt, max_new_tokens=30, k=4, sampling=sampling,
                                         cape=cape, compile=step)
                assert drafter.cache is None  # (its cache back in the pool: the drafter holds none)
                out.append((r.tokens, r.accepted, r.proposed))
        return out

    monkeypatch.setenv("LONGCTX_REUSE_CACHES", "0")
    without = all_runs()
    assert not POOL.held(draft)
    monkeypatch.setenv("LONGCTX_REUSE_CACHES", "1")
    made = POOL.made
    with_reuse = all_runs()
    assert with_reuse == without
    assert len(POOL.held(draft)) == 1 and len(POOL.held(target)) == 1
    assert POOL.made - made == 2  # (one target cache and one draft cache, each reused by the five runs after)
    plain = generate(target, [_prompt(20, 1)], max_new_tokens=30)[0].tokens
    assert without[0][0] == without[1][0] == plain  # (greedy speculation, chain and tree: the target's tokens)


def test_a_drafts_cache_is_dropped_after_an_error_and_a_drafter_on_its_own_makes_one():
    target, draft = _spec_models()
    prompt = _prompt(20, 1)
    drafter = ModelDrafter(draft, len(prompt) + 20 + 4 + 2)

    def stop(row, tokens):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        speculative_generate(target, drafter, prompt, max_new_tokens=20, k=4, stop=stop)
    assert not POOL.held(draft) and drafter.cache is None
    with torch.inference_mode():  # (a drafter used on its own, as tests and rewinds do: its own cache, kept)
        drafter.start(prompt)
    assert drafter.cache is not None and not POOL.held(draft)


def test_a_glide_drafter_lets_go_of_the_targets_cache():
    """After the generation the target's cache is back in the pool, another generation's to lease: the GliDe
    drafter, whose cross-attention reads it, no longer holds it (a propose after would read that one's rows)."""
    target = _model(seed=1, layers=2)
    draft = GlideDraft(target.cfg, layers=1).init_weights(seed=7, std=0.1)
    prompt = _prompt(20, 1)
    drafter = GlideDrafter(draft, target, len(prompt) + 20 + 4 + 2, block=4)
    r = speculative_generate(target, drafter, prompt, max_new_tokens=20, k=4)
    assert r.tokens == generate(target, [prompt], max_new_tokens=20)[0].tokens
    assert len(POOL.held(target)) == 1 and drafter.target_cache is None
    assert drafter.cache is not None  # (its own cache, eager and not pooled, stays: rewind reads it)


class Frozen(StandIn):
    """The stand-in capture that also records what a real CUDA graph freezes at its capture: the addresses it
    reads (each weight's, the cache's keys and values, the block's buffers) and the constants it holds (the
    RoPE attention scale); its replay fails where any of them changed (the real graph would replay the old)."""

    def __init__(self, steps):
        super().__init__(steps)
        self.frozen = _frozen(steps.__self__)

    replays = 0

    def replay(self):
        assert _frozen(self.steps.__self__) == self.frozen, "a graph replayed on other addresses or constants"
        super().replay()
        Frozen.replays += 1


def _frozen(block) -> tuple:
    model, cache = block.model(), block.cache
    tensors = [*model.parameters(), *model.buffers(), cache.k, cache.v, block.chosen, block.start, block.tokens]
    return model.rope_scale, [(t.device, t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors]


def test_no_graph_replays_on_other_addresses_or_constants(monkeypatch):
    """Generations of one model between which its weights move, come back, change in place, are reloaded and
    its RoPE scale changes: a replayed graph always finds what it was captured on, and the tokens are a fresh
    model's."""
    monkeypatch.setattr(blocks, "capture_for", lambda device: Frozen)
    model, prompt, new, step = _model(), _prompt(27), 3 * BLOCK + 1, Counted()
    reference = _model()
    Frozen.replays = 0

    def check():
        reference.load_state_dict(model.state_dict())
        reference.rope_scale = model.rope_scale
        replays = Frozen.replays
        got = generate(model, [prompt], max_new_tokens=new, compile=step)[0].tokens
        assert got == generate(reference, [prompt], max_new_tokens=new)[0].tokens
        assert Frozen.replays > replays  # (each generation replays: the third block, or every block on a kept cache)

    check()
    model.double()
    check()
    model.float()
    check()
    with torch.no_grad():
        model.output.weight.mul_(1.5)  # (in place)
    check()
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach() * 0.5)  # (replaced)
    check()
    model.init_rope()  # (a new rope table)
    check()
    model.rope_scale = 0.8  # (a constant of the graph)
    check()
