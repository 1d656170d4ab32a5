"""A verification call on a sharded cache (generate/sharded.py _partial_masked: held slots by one kernel
call, the call's own slots by a masked softmax, merged by the log-sum-exp) inside real ranks: every
layer's partial (out, lse) of every rank equals the replaced path (one fp32 softmax over all the rank's
slots with the full mask) to 1e-6, for a chain and a tree on ragged rows (one of 3 tokens: some ranks
hold none of its prompt) under head 2 x ctx 2 and ctx 2, GQA (4 query heads over 2 kv heads)."""

import pytest
import torch

from longctx.job.spawn import run_spawned

LENGTHS = [300, 37, 3, 121]


def _rank(head: int, ctx: int) -> dict:
    import sys

    from longctx.config import load_config
    from longctx.generate import sharded
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime
    from longctx.models.llama import build_model

    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/unit")
    from test_sharded_verify_split import _reference

    cfg = load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"])
    rt = Runtime.create(cfg, torch.distributed.get_rank(), head * ctx, "cpu")
    model = build_model(load_config(overrides=["--model.layers=2"]).model, seed=3).eval()
    backend, worst, calls = ShardedGeneration(rt.mesh, rt.world_mesh), [0.0], [0]
    split = sharded._partial_masked

    def checked(q, keys, values, before, mine, held, step):
        out, lse = split(q, keys, values, before, mine, held, step)
        want_out, want_lse = _reference(q, keys, values, before, mine, held, step.among)
        calls[0] += 1
        worst[0] = max(worst[0], (out - want_out).abs().max().item(),
                       (torch.nan_to_num(lse, neginf=0.0) - torch.nan_to_num(want_lse, neginf=0.0)).abs().max().item())
        return out, lse

    sharded._partial_masked = checked
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in LENGTHS]
    with torch.inference_mode():
        cache = backend.cache(model, len(seqs), max(LENGTHS) + 16)
        for r, seq in enumerate(seqs):
            backend.prefill(model, cache.rows(r, r + 1), torch.tensor([seq]), 4096)
        model(torch.tensor([[5, 6, 7, 8]] * len(seqs)), cache=cache)  # a chain of 4 on every row
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        cache.among(tree)
        model(torch.tensor([[1, 2, 3, 4]] * len(seqs)), cache=cache)
    return {"worst": worst[0], "calls": calls[0]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 2)], ids=["head2xctx2", "ctx2"])
def test_split_verification_equals_the_replaced_path_on_every_rank(layout):
    for found in run_spawned(layout[0] * layout[1], _rank, *layout):
        assert found["calls"] == 4 and found["worst"] < 1e-6, found
