"""A sharded prefill's count on two ranks (helper genprog113; the counting logic alone: tests/unit/test_genprog113.py).

`longctx generate --nproc 2` (head or ctx ranks) prefilled a prompt in one model call with no count: a 128K-token
prompt was minutes of its prompts' phase with nothing moving. Now a prompt longer than a prefill chunk is a phase
on rank 0 counting its prompt tokens layer by layer; rank 1 says nothing; the tokens are those of a run without
the lines (LONGCTX_PROGRESS_S=0), on every rank."""

import os

import pytest
import torch

LAYOUTS = [(1, 2), (2, 1)]  # (head, ctx): ctx 2, head 2
LAYERS, LENGTH, CHUNK, NEW = 3, 96, 32, 6


def _generate_sharded(head: int, ctx: int, interval: str):
    """On this rank: (what the running phase said as each block started during the prefill, the tokens of a greedy
    generation, whether hooks were left on the blocks)."""
    import time

    from longctx import progress
    from longctx.config import load_config
    from longctx.generate.engine import generate
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime
    from longctx.models.llama import build_model

    os.environ[progress.INTERVAL_ENV] = interval
    model = build_model(load_config(overrides=[f"--model.layers={LAYERS}"]).model, seed=3).eval()
    rt = Runtime.create(load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"]),
                        torch.distributed.get_rank(), head * ctx, "cpu")
    seen = []

    def layer_starts(module, _args):
        with progress._HEARTBEAT.lock:
            phases = list(progress._HEARTBEAT.phases)
        if phases and phases[-1].what.startswith("prefill"):
            seen.append((phases[-1].describe(time.monotonic()), phases[-1].done))

    hooks = [layer.register_forward_pre_hook(layer_starts) for layer in model.layers]
    prompt = torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(7)).tolist()
    try:
        out = generate(model, [prompt], max_new_tokens=NEW, prefill_chunk=CHUNK,
                       backend=ShardedGeneration(rt.mesh, rt.world_mesh))[0]
    finally:
        for h in hooks:
            h.remove()
    return seen, out.tokens, any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.layers)


@pytest.fixture(scope="module")
def runs():
    from longctx.job.spawn import run_spawned_many

    return run_spawned_many(2, [((layout, interval), _generate_sharded, (*layout, interval))
                                for layout in LAYOUTS for interval in ("0", "20")])


@pytest.mark.parametrize("layout", LAYOUTS, ids=["head1-ctx2", "head2-ctx1"])
def test_a_sharded_prefill_is_counted_layer_by_layer_on_rank_0_with_the_same_tokens(layout, runs):
    head, ctx = layout
    (said, tokens, hooked), (said_1, tokens_1, hooked_1) = runs[(layout, "20")]
    share = LENGTH / LAYERS
    assert [done for _, done in said] == [share * k for k in range(LAYERS)], said  # rank 0: each block its share
    assert all(line.startswith(f"prefill of 1 prompt of {LENGTH} tokens, sharded over head {head} x ctx {ctx} [")
               for line, _ in said), said
    assert [line.split(": ")[1].split(" prompt")[0] for line, _ in said] == \
        [f"{share * k:.0f}/{LENGTH}" for k in range(LAYERS)]
    assert said_1 == []  # rank 1 says nothing
    assert not hooked and not hooked_1
    assert len(tokens) == NEW and tokens == tokens_1
    for rank_quiet in runs[(layout, "0")]:  # lines off: no phase, the same tokens
        assert rank_quiet[0] == [] and rank_quiet[1] == tokens
