"""Randomized audit of generation past the trained window (docs/generate.md "InfLLM context memory", "Ms-PoE"):
the float32 model against tests/infllm_fuzz118_reference.py, a float64 plain-PyTorch model written from the docs'
words (its own RoPE, the units, representatives, top-k and positions laid out per query).

- InfLLM (models/context_memory.py through generate/context_memory.py's backend): random shapes (GQA, head_dim,
  RoPE base and scaling none / linear / yarn / llama3 (their frequencies by transformers), q/k/v biases, q/k
  norms, tied head), block, repr, topk, init, window,
  placement, prefill chunk; prompts past the memory's start by 0 and 1 token,
  1 block, many blocks, not multiples of the block; 1 or 2 rows (the memory takes rows of one length: rows of
  different lengths are refused). Every prefill chunk's logits at every position and each greedy decode step's
  logits within 1e-4 of the reference, the same greedy tokens, each call's chosen units (row 0) the reference's,
  and the keys one call reads the reference's count, at most init + topk x block + window + block - 1; every
  distance a query sees below the shape's positions_needed, which the length guard (check_reach) holds to.
- Sharded over 2 ctx ranks (generate/sharded_infllm.py, a spawned gloo job: slow): one process's greedy tokens.
- Ms-PoE (models/ms_poe.py), plain, linear, yarn and llama3 RoPE: the ratios of both orders (index; attention, the probe
  written out again) and the logits of a full forward and of cached decoding against per-head scaled RoPE."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from infllm_fuzz118_reference import InfLLMRef, Ref64, ms_poe_ratios
from longctx.config import ModelConfig
from longctx.config.positions import Reach
from longctx.errors import ConfigError
from longctx.generate.context_memory import InfLLMGeneration, check_reach
from longctx.models.context_memory import InfLLMShape
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _case(seed):
    """(model, shape, prompt rows, prefill chunk, decode steps) drawn from `seed`."""
    rnd = random.Random(seed)
    kv = rnd.choice([1, 2, 3])
    heads = kv * rnd.choice([1, 2, 3])
    cfg = ModelConfig(dim=rnd.choice([32, 48]), layers=rnd.choice([1, 2]), heads=heads, kv_heads=kv,
                      head_dim=rnd.choice([8, 12, 16]), ffn_dim=64, vocab_size=61, init_std=0.3,
                      rope_theta=rnd.choice([10000.0, 500.0]),
                      rope_scaling=rnd.choice(["none", "none", "linear", "yarn", "llama3"]),
                      rope_factor=rnd.choice([2.0, 4.0]), rope_original_max_len=rnd.choice([16, 32, 8192]),
                      qkv_bias=rnd.random() < 0.3, qk_norm=rnd.random() < 0.3,
                      tie_embeddings=rnd.random() < 0.3)
    block = rnd.choice([2, 3, 4, 5])
    shape = InfLLMShape(block=block, repr=rnd.randint(1, block), topk=rnd.randint(1, 4),
                        window=block * rnd.randint(2, 4), init=rnd.randint(0, 5),
                        positions=rnd.choice(["shared", "ordered"]))
    start = shape.init + shape.window + shape.block  # the first length holding a unit
    many = rnd.randint(5, 16) * block + rnd.randint(1, block - 1)  # many units and a partial block
    # the first seeds: no unit yet (-1), the first unit (0), past it by 1 token and by 1 block; then random
    past = [-1, 0, 1, block][seed] if seed < 4 else rnd.choice([-1, 0, 1, block, block + 1, many, many, many])
    length = start + past
    rows = rnd.choice([1, 2])
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (rows, length), generator=g)
    chunk = rnd.randint(1, shape.window // 2)
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():  # (biases start at 0 and norms at 1: drawn, so that a reference ignoring them shows)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model, shape, prompt, chunk, rnd.randint(3, 6)


def _run_and_compare(seed):
    model, shape, prompt, chunk, steps = _case(seed)
    rows, length = prompt.shape
    backend = InfLLMGeneration(shape)
    ref = InfLLMRef(model, shape, rows)
    chosen = {}
    with torch.inference_mode():
        cache = backend.cache(model, rows, length + steps)
        memory = backend.memory
        real_select = type(memory)._select

        def select(index, q_far, units):  # (records each call's choice: the reference's must be the same)
            picked = real_select(memory, index, q_far, units)
            chosen[(index, int(cache.lengths[0]) + q_far.shape[1])] = picked[0].tolist()
            return picked

        memory._select = select
        c = backend.chunk(chunk)
        for s in range(0, length, c):
            got = model(prompt[:, s:s + c], cache=cache)
            torch.testing.assert_close(got.double(), ref.call(prompt[:, s:s + c]), atol=ATOL, rtol=0,
                                       msg=lambda m, s=s: f"seed {seed} prefill at {s}: {m}")
        tokens = got[:, -1].argmax(-1, keepdim=True)
        for step in range(steps):
            want = ref.call(tokens)
            got = model(tokens, cache=cache)
            torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0,
                                       msg=lambda m, step=step: f"seed {seed} decode step {step}: {m}")
            assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1)), (seed, step)
            tokens = got[:, -1].argmax(-1, keepdim=True)
    assert chosen == ref.chosen, seed
    assert memory.keys_read == ref.keys_read, seed
    assert memory.keys_read <= shape.max_keys
    # every distance below the positions the shape says it needs (the length guard's number: config/positions.py)
    assert ref.distance < shape.positions_needed, (seed, ref.distance, shape.positions_needed)
    reach = Reach(positions=shape.positions_needed, trained=shape.positions_needed, unscaled=0, source="fuzz")
    check_reach(shape, reach)
    with pytest.raises(ConfigError, match="past the"):
        check_reach(shape, dataclasses.replace(reach, positions=shape.positions_needed - 1))
    return model, shape, prompt, chosen


SEEDS = list(range(32))


@pytest.mark.parametrize("seed", SEEDS)
def test_infllm_matches_the_float64_reference(seed):
    _run_and_compare(seed)


def test_cases_cover_the_edges():
    """The drawn cases cover what the audit claims: both placements, GQA and MHA, memory absent and present,
    a prompt past the memory's start by one token and by many blocks, two rows, top-k below the units."""
    seen = set()
    for seed in SEEDS:
        model, shape, prompt, _, _ = _case(seed)
        units = (prompt.shape[1] - shape.window - shape.init) // shape.block
        start = shape.init + shape.window + shape.block
        seen |= {shape.positions, model.cfg.heads > model.cfg.kv_heads, model.cfg.heads == model.cfg.kv_heads,
                 ("rows", prompt.shape[0]), ("past", min(prompt.shape[1] - start, 2)), units > shape.topk,
                 (prompt.shape[1] - shape.init) % shape.block != 0}
    assert {"shared", "ordered", ("rows", 2), ("past", -1), ("past", 0), ("past", 1), ("past", 2)} <= seen
    assert {True} <= seen and False in seen


def test_rows_of_different_lengths_are_refused():
    model, shape, prompt, chunk, _ = _case(3)
    backend = InfLLMGeneration(shape)
    prompt = torch.cat([prompt[:1], prompt[:1]])
    with torch.inference_mode():
        cache = backend.cache(model, 2, prompt.shape[1] + 2)
        backend.prefill(model, cache, prompt, chunk)
        cache.lengths = np.array([prompt.shape[1], prompt.shape[1] - 1])
        with pytest.raises(ValueError, match="same number of tokens"):
            model(prompt[:, :1], cache=cache)


def test_the_cache_holds_the_context_and_reads_a_bounded_share():
    """docs/generate.md: the memory offloads nothing (the KV cache holds every slot, on the model's device);
    what is bounded is the keys a call reads, init + topk x block + window + block - 1 whatever the prompt."""
    cfg = ModelConfig(dim=32, layers=1, heads=2, kv_heads=1, ffn_dim=64, vocab_size=61, init_std=0.3)
    model = build_model(cfg, seed=1).eval()
    shape = InfLLMShape(block=4, repr=2, topk=2, window=8, init=2, positions="ordered")
    backend = InfLLMGeneration(shape)
    prompt = torch.randint(0, 61, (1, 403), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = backend.cache(model, 1, 410)
        backend.prefill(model, cache, prompt, 4)
        for _ in range(3):
            model(prompt[:, :1], cache=cache)
    assert isinstance(cache, KVCache) and cache.k.shape[3] == 410 and cache.k.device == model.inv_freq.device
    assert backend.memory.keys_read == shape.max_keys == 2 + 8 + 8 + 4 - 1


def _sharded_tokens(seed, ctx):
    """Greedy tokens of case `seed`'s first row on this rank (ctx > 1: the sharded memory)."""
    from longctx.generate.engine import generate

    model, shape, prompt, chunk, steps = _case(seed)
    if ctx == 1:
        backend = InfLLMGeneration(shape)
    else:
        from longctx.config import load_config
        from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
        from longctx.job.runtime import Runtime

        rt = Runtime.create(load_config(overrides=[f"--parallel.ctx={ctx}"]), torch.distributed.get_rank(), ctx, "cpu")
        backend = ShardedInfLLMGeneration(shape, rt.mesh)
    return generate(model, [prompt[0].tolist()], max_new_tokens=steps + 6, prefill_chunk=chunk,
                    backend=backend)[0].tokens


def _sharded_seeds():
    """Two cases of each placement with more units than top-k (units on both ranks, a real choice)."""
    out = {"shared": [], "ordered": []}
    for seed in SEEDS:
        _, shape, prompt, _, _ = _case(seed)
        if (prompt.shape[1] - shape.window - shape.init) // shape.block > shape.topk + 2:
            out[shape.positions].append(seed)
    return out["shared"][:2] + out["ordered"][:2]


SHARDED_SEEDS = _sharded_seeds()


@pytest.mark.slow
def test_sharded_over_two_ctx_ranks_gives_one_process_tokens():
    from longctx.job.spawn import run_spawned_many

    got = run_spawned_many(2, [(s, _sharded_tokens, (s, 2)) for s in SHARDED_SEEDS], timeout=600)
    for s in SHARDED_SEEDS:
        want = _sharded_tokens(s, 1)
        assert got[s] == [want, want], s


MS_POE = [dict(kv_heads=4, heads=8, rope_ms_poe_order="attention", rope_ms_poe_skip_layers=1, layers=3),
          dict(kv_heads=3, heads=3, rope_ms_poe_order="index", rope_ms_poe_skip_layers=0, layers=2),
          dict(kv_heads=1, heads=2, rope_ms_poe_order="attention", rope_ms_poe_skip_layers=1, layers=2),
          dict(kv_heads=2, heads=6, rope_ms_poe_order="attention", rope_ms_poe_skip_layers=0, layers=2,
               rope_ms_poe_min=1.0, rope_ms_poe_max=3.0),
          dict(kv_heads=3, heads=6, rope_ms_poe_order="attention", rope_ms_poe_skip_layers=1, layers=2,
               rope_scaling="linear", rope_factor=2.0),
          dict(kv_heads=2, heads=4, rope_ms_poe_order="index", rope_ms_poe_skip_layers=0, layers=1,
               rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32),
          dict(kv_heads=2, heads=4, rope_ms_poe_order="attention", rope_ms_poe_skip_layers=1, layers=2,
               rope_scaling="llama3", rope_factor=4.0, rope_original_max_len=16)]


@pytest.mark.parametrize("case", range(len(MS_POE)))
def test_ms_poe_ratios_and_logits(case):
    fields = dict(dim=48, head_dim=12, ffn_dim=64, vocab_size=61, init_std=0.3, max_seq_len=96, rope_ms_poe=True)
    model = build_model(ModelConfig(**{**fields, **MS_POE[case]}), seed=case).eval()
    want = ms_poe_ratios(model)
    torch.testing.assert_close(model.ms_poe_ratios.double(), want, atol=1e-6, rtol=0)
    if model.cfg.kv_heads > 1 and model.cfg.layers > model.cfg.rope_ms_poe_skip_layers:
        assert len(set(want[-1].tolist())) == model.cfg.kv_heads  # spread: a reversal or a swap would show
    tokens = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(case))
    ref = Ref64(model, want).forward(tokens)
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens).double(), ref, atol=ATOL, rtol=0)
        cache = KVCache.for_model(model, 2, 40)
        model(tokens[:, :31], cache=cache)
        for i in range(31, 40):  # cached decode sees the same scaled distances
            torch.testing.assert_close(model(tokens[:, i:i + 1], cache=cache)[:, 0].double(), ref[:, i], atol=ATOL,
                                       rtol=0)
