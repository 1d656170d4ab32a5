"""MoE routing that looks across a call's tokens (a capacity; the Sinkhorn router's balanced
assignment) under expert parallelism with memory.block_chunk (memory/apply_policy.py): each rank's
call is routed as one call, its pieces then meet their experts one exchange each, as before. So a
run in block chunks trains as the same layout without them: the first step's loss and router
statistics (drops included) within fp32 rounding, the next steps' within 1e-5 (capacity) and 1e-3
(Sinkhorn: its assignment turns a rounding-level change of the weights into a few changed choices;
memory.loss_chunk alone moves its third loss by 1e-4), 2 ranks (expert 2 x ctx 2), gloo.

Capacity and Sinkhorn act on every token of the micro-batch, over the ranks (models/moe_capacity.py): the
pieces on each rank are gathered with the other ranks' tokens. The reference here is the same layout
without chunks; tests/distributed/test_moe_capacity_layouts.py compares layouts (block chunks included)
with one process."""

from pathlib import Path

import pytest
from test_training_parity import BASE, NO_SAVE

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import train

STEPS = 3
LAYOUT = ["--parallel.expert=2", "--parallel.ctx=2", "--memory.recompute=selective"]
MOE = [*BASE, *NO_SAVE, "--model.preset=debug-moe", "--metrics.log_interval=1", f"--train.steps={STEPS}", *LAYOUT]
ROUTERS = {
    "capacity": ["--model.moe.capacity_factor=1.0"],
    "sinkhorn": ["--model.moe.router=sinkhorn"],
}
CHUNK = 48  # a rank holds 2 x 128 tokens: 6 pieces, the last one shorter
STATS = ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate")


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe-pieces-ep")
    jobs = [(f"{router} chunk{chunk}", _train, ([*MOE, *extra, f"--memory.block_chunk={chunk}"],
                                                 str(base / f"{router}-{chunk}")))
            for router, extra in ROUTERS.items() for chunk in (0, CHUNK)]
    results = run_spawned_many(2, jobs)
    stats = {}
    for key, _, (_, run_dir) in jobs:
        lines = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "moe_aux_loss" in r]
        stats[key] = [{k: r[k] for k in STATS} for r in lines]
    return results, stats


@pytest.mark.parametrize("router", list(ROUTERS))
def test_block_chunks_route_as_the_unchunked_run(router, runs):
    results, stats = runs
    plain, chunked = f"{router} chunk0", f"{router} chunk{CHUNK}"
    later = 1e-5 if router == "capacity" else 1e-3
    for a, b in zip(results[plain], results[chunked], strict=True):  # per rank
        assert len(a) == len(b) == STEPS
        print(f"{router}: |loss chunked - plain| per step " + " ".join(f"{abs(x - y):.1e}" for x, y in zip(a, b)))
        assert abs(a[0] - b[0]) <= 1e-6, (router, a, b)
        assert max(abs(x - y) for x, y in zip(a, b)) <= later, (router, a, b)
    for step, (s, r) in enumerate(zip(stats[chunked], stats[plain], strict=True)):
        for k in STATS:
            assert s[k] == pytest.approx(r[k], abs=1e-6 if step == 0 else later), (router, step, k, s[k], r[k])
    if router == "capacity":
        assert all(r["moe_drop_rate"] > 0 for r in stats[plain])  # (the capacity binds)
