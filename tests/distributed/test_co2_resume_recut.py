"""A co2 run resumed under its checkpoint's layout but with parallel.zero_pp's hpz added (review, 2026-12-04).
hpz keeps FSDP's cut on dim 0 (parallel/fsdp/shard.py), without it a MoE layer's [experts, ...] tensors over more
ranks than experts are cut on another dim (costs/model_states.py shard_dim), and the checkpoint's layout record
does not name zero_pp: each rank read its own CO2 state (local tensors of the old cut) as its own, and every rank
raised "the CO2 state holds 139648 local elements in 13 tensors; this rank has 164288 in 13" (115008 on the others).
Now the run goes on from the layout-free weights and AdamW state and says what was not carried over. 3 experts
over a replica of 2 ranks; 2 replicas (4 ranks), nodes of 2 (hpz over the whole replica, which co2 accepts)."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.slow  # three 4-rank runs of 4, 2 and 2 steps: ~50 s on a 2-core CPU

BASE = ["--model.preset=debug-moe", "--model.moe.experts=3", "--model.moe.top_k=1", "--model.layers=1",
        "--model.moe.dense_layers=", "--train.seq_len=64", "--train.global_batch=4", "--train.steps=4",
        "--train.warmup_steps=1", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=100", "--parallel.dp_replicate=2", "--parallel.ranks_per_node=2",
        "--train.data_parallel=co2", "--train.co2_local_steps=2", "--checkpoint.interval=2", "--train.device=cpu"]


def _run(args, run_dir):
    from longctx.train.trainer import train

    lines: list[str] = []
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    res = train(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return res.first_step, res.losses, [x for x in lines if x.startswith("co2: ")]


def test_a_co2_resume_with_hpz_added_goes_on_from_the_weights(tmp_path):
    saved = tmp_path / "checkpoints" / "step-00000002"
    # the three runs one after another in one job (run_spawned_many: a job each started 4 ranks three times);
    # both resumes read the uninterrupted run's step-2 checkpoint, saved before it returns
    runs = run_spawned_many(4, [
        ("uninterrupted", _run, (["--checkpoint.final=false"], str(tmp_path))),
        # (the same cut: each rank's CO2 state is restored, and the run goes on as if never stopped)
        ("same", _run, ([f"--checkpoint.resume={saved}"], str(tmp_path / "same"))),
        ("hpz", _run, (["--parallel.zero_pp=hpz", f"--checkpoint.resume={saved}"], str(tmp_path)))])
    uninterrupted, same = runs["uninterrupted"][0][1], runs["same"][0]
    assert same[0] == 3 and max(abs(a - b) for a, b in zip(same[1], uninterrupted[2:], strict=True)) < 1e-5, same
    assert not any("otherwise" in x or "another layout" in x for x in same[2]), same[2]
    ranks = runs["hpz"]
    for first, losses, _ in ranks:
        assert first == 3 and len(losses) == 2, (first, losses)
    said = ranks[0][2]  # (rank 0 speaks for the job)
    assert any("cut its tensors otherwise" in x and "not carried over" in x for x in said), said
