"""Speculative decoding on a target cache sharded over head 2 x ctx 2 (generate/sharded.py) against one
process, where the existing layout tests (test_generate_layouts.py) look only at greedy output:
- the cache each rank is left with after chain rounds (rejections rolled back by `truncate`) and CaPE
  tree rounds (the accepted path kept by `keep`): over each head group's ctx ranks, every position
  0..length-1 held exactly once, with one process's keys and values at it. A rank that kept a rejected
  token's slot, or recorded a kept node at the wrong position, shows here even where later greedy
  tokens happen not to change;
- sampled speculation with many rejections (a noisy draft: residual draws), three seeds, fixed and
  adaptive K: every rank draws one process's tokens, kept counts and K per round, so the ranks take
  the same accept/reject decisions from the same random numbers."""

import numpy as np
import pytest
import torch

from longctx.job.spawn import run_spawned_many

PROMPT = 301  # not a multiple of the layout's 2 x head x ctx: the prefill pads, and the shares start uneven


def _model(noise: float = 0.0):
    """A random 2-layer model; with `noise`, the same with a noisy LM head (a draft that agrees sometimes)."""
    from longctx.config import load_config
    from longctx.models.llama import build_model

    model = build_model(load_config(overrides=["--model.layers=2"]).model, seed=3).eval()
    if noise:
        with torch.no_grad():
            w = model.lm_head_weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * noise)
    return model


def _prompt():
    return torch.randint(0, 320, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()


def _backend(head: int, ctx: int):
    from longctx.generate.local import LOCAL

    if head * ctx == 1:
        return LOCAL
    from longctx.config import load_config
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    rt = Runtime.create(load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"]),
                        torch.distributed.get_rank(), head * ctx, "cpu")
    return ShardedGeneration(rt.mesh, rt.world_mesh)


def _rounds_and_cache(head: int, ctx: int, rounds: int = 10):
    """Greedy rounds by hand, chain (K = 4) and CaPE tree alternating: (each round's kept tokens and next
    pending one, the length, then this rank's cache: head rank, slot positions, keys, values, shares;
    one process: its keys and values [layers, kv heads, length, d])."""
    from longctx.generate.cape import DEFAULT_TABLE, CapeTable, tree_round
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.local import LOCAL
    from longctx.generate.sampling import GREEDY
    from longctx.generate.speculative import speculative_round
    from longctx.models.kv_cache import KVCache

    backend, target, table = _backend(head, ctx), _model(), CapeTable.parse(DEFAULT_TABLE)
    drafter = ModelDrafter(_model(noise=0.6), 500)
    cache = KVCache.for_model(target, 1, 400) if backend is LOCAL else backend.cache(target, 1, 400)
    taken = []
    with torch.inference_mode():
        pending = int(backend.prefill(target, cache, torch.tensor([_prompt()]), 4096)[0].argmax())
        drafter.start(_prompt(), cache)
        for i in range(rounds):
            if i % 2:
                kept, pending, _, _ = tree_round(target, cache, drafter, pending, 4, table)
            else:
                kept, pending, _ = speculative_round(target, cache, drafter, pending, 4, GREEDY, None)
            taken.append((list(kept), pending))
    n = int(cache.lengths[0])
    if backend is LOCAL:
        return taken, n, cache.k[:, 0, :, :n].clone(), cache.v[:, 0, :, :n].clone()
    held = int(cache.local[0])
    return (taken, n, cache.head_rank, cache.slot_positions[0, :held].copy(), cache.k[:, 0, :, :held].clone(),
            cache.v[:, 0, :, :held].clone(), cache.shares[0].copy())


def _sampled(head: int, ctx: int, adaptive: bool):
    """Sampled speculation (T = 1, top-k 20, K = 4, a noisy draft), seeds 1..3: per seed (tokens, kept per
    round, logprobs, each round's K when adaptive)."""
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.sampling import Sampling
    from longctx.generate.spec_length import AdaptiveLength
    from longctx.generate.speculative import speculative_generate

    backend, target, draft = _backend(head, ctx), _model(), _model(noise=1.5)
    got = []
    for seed in (1, 2, 3):
        length = AdaptiveLength(4, 0.3, verify_cost=0.2, probe_every=2) if adaptive else False
        out = speculative_generate(target, ModelDrafter(draft, 500), _prompt(), max_new_tokens=20, k=4,
                                   backend=backend, sampling=Sampling(temperature=1.0, top_k=20, seed=seed),
                                   logprobs=0, adaptive=length)
        got.append((out.tokens, out.accepted, out.logprobs, length.chosen if adaptive else None))
    return got


@pytest.fixture(scope="module")
def head2xctx2():
    return run_spawned_many(4, [("cache", _rounds_and_cache, (2, 2)), ("sampled", _sampled, (2, 2, False)),
                                ("adaptive", _sampled, (2, 2, True))])


@pytest.mark.slow
def test_every_rank_keeps_exactly_the_accepted_tokens_after_chain_and_tree_rounds(head2xctx2):
    want_taken, length, want_k, want_v = _rounds_and_cache(1, 1)
    assert any(len(kept) < 4 for kept, _ in want_taken) and any(kept for kept, _ in want_taken)  # rejections, keeps
    by_head: dict[int, list] = {}
    for taken, n, head_rank, positions, k, v, shares in head2xctx2["cache"]:
        assert taken == want_taken and n == length
        assert shares.sum() == length
        by_head.setdefault(head_rank, []).append((positions, k, v))
    kv = want_k.shape[1] // 2  # (the dense model has no kv replication: each head rank holds half its kv heads)
    for head_rank, parts in by_head.items():
        positions = np.concatenate([p for p, _, _ in parts])
        assert sorted(positions.tolist()) == list(range(length))  # each position on exactly one ctx rank
        order = torch.as_tensor(np.argsort(positions))
        heads = slice(head_rank * kv, (head_rank + 1) * kv)
        torch.testing.assert_close(torch.cat([k for _, k, _ in parts], 2)[:, :, order], want_k[:, heads],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([v for _, _, v in parts], 2)[:, :, order], want_v[:, heads],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sampled", "adaptive"])
def test_sampled_speculation_draws_one_process_tokens_on_every_rank(case, head2xctx2):
    want = _sampled(1, 1, case == "adaptive")
    assert sum(len(kept) for _, kept, _, _ in want) > sum(sum(kept) for _, kept, _, _ in want)  # many rejections
    for per_rank in head2xctx2[case]:
        for (tokens, kept, logprobs, chosen), (w_tokens, w_kept, w_logprobs, w_chosen) in zip(per_rank, want):
            assert tokens == w_tokens and kept == w_kept and chosen == w_chosen
            assert np.allclose(logprobs, w_logprobs, atol=1e-4, rtol=0)
