"""`longctx generate --nproc N` with a GliDe draft in bf16 (the dtype a CUDA card gets by default): the draft's
cross-attention reads the target's sharded cache (generate/sharded.py read_attention), which merged its ranks'
partials in fp32 and handed them back in fp32, so the draft's bf16 output projection failed ("expected m1 and
m2 to have the same dtype") at the first proposal, under ctx 2 and under head 2 alike (the head-only read is
masked_attention's fp32 too). fp32 runs, the only ones the layouts' tests made (test_generate_layouts.py),
never saw it. Here, in bf16 under ctx 2 and head 2: the read comes back in the query's dtype and within bf16's
rounding of one process's read, the draft's log-probabilities within bf16's rounding of one process's, and
speculation runs to its limit with every rank returning the same tokens."""

import pytest
import torch

NEW = 12
LAYOUTS = [(1, 2), (2, 1)]  # ctx 2 (the ctx merge), head 2 (each rank its heads, gathered)


def _target():
    from longctx.config import load_config
    from longctx.models.llama import build_model

    return build_model(load_config(overrides=["--model.layers=2"]).model, seed=3).eval().to(torch.bfloat16)


def _glide(target):
    from longctx.models.glide import GlideDraft

    return GlideDraft(target.cfg, 1).init_weights(seed=5, std=0.2).eval().to(torch.bfloat16)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _backend_and_cache(head: int, ctx: int, model, max_len: int):
    from longctx.generate.local import LOCAL
    from longctx.models.kv_cache import KVCache

    if head * ctx == 1:
        return LOCAL, KVCache.for_model(model, 1, max_len)
    from longctx.config import load_config
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    rt = Runtime.create(load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"]),
                        torch.distributed.get_rank(), head * ctx, "cpu")
    backend = ShardedGeneration(rt.mesh, rt.world_mesh)
    return backend, backend.cache(model, 1, max_len)


def _glide_bf16(head: int, ctx: int):
    """In bf16 on one process (1 x 1) or head x ctx ranks: (the last layer's read of the target's cache by
    every query position of a 301-token prompt, the draft's log-probabilities [3, vocab] over 3 proposals
    after it, the tokens of greedy speculation with K = 3)."""
    from longctx.generate.drafters import GlideDrafter
    from longctx.generate.sampling import Sampling
    from longctx.generate.speculative import speculative_generate
    from longctx.models.cached_attention import masked_attention

    target = _target()
    draft = _glide(target)
    prompt = _prompt(301, seed=6)
    backend, cache = _backend_and_cache(head, ctx, target, 400)
    cfg = target.cfg
    q = torch.randn(1, 4, cfg.heads, cfg.resolved_head_dim, generator=torch.Generator().manual_seed(0))
    q = q.to(torch.bfloat16)
    limit = torch.tensor([[1, 150, 300, 301]])
    drafter = GlideDrafter(draft, target, 400, block=3)
    with torch.inference_mode():
        backend.prefill(target, cache, torch.tensor([prompt]), 4096)
        if head * ctx > 1:
            read = cache.read_attention(cfg.layers - 1, q, limit)
        else:
            slots = torch.arange(cache.k.shape[3])
            visible = (slots[None, None] < limit[..., None]) & (slots < 301)
            read = masked_attention(q, cache.k[cfg.layers - 1], cache.v[cfg.layers - 1], visible)[0].to(q.dtype)
        drafter.start(prompt, cache)
        _, proposals = drafter.propose(7, 3, Sampling(temperature=1.0), None)
    out = speculative_generate(target, GlideDrafter(draft, target, 400, block=3), prompt, max_new_tokens=NEW, k=3,
                               backend=backend)
    return read, proposals.float().log(), out.tokens


@pytest.fixture(scope="module")
def bf16_layouts():
    from longctx.job.spawn import run_spawned_many

    return run_spawned_many(2, [(layout, _glide_bf16, layout) for layout in LAYOUTS])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=["ctx2", "head2"])
def test_a_glide_draft_in_bf16_reads_the_sharded_cache_and_speculates(layout, bf16_layouts):
    want_read, want_q, _ = _glide_bf16(1, 1)
    per_rank = bf16_layouts[layout]
    for read, q, tokens in per_rank:
        assert read.dtype == torch.bfloat16  # the draft's dtype: its output projection takes it
        torch.testing.assert_close(read.float(), want_read.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(q, want_q, atol=2e-2, rtol=2e-2)
        assert len(tokens) == NEW and tokens == per_rank[0][2]  # to its limit, every rank the same tokens
