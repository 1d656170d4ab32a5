"""`expert_rank_load` of a real run under expert parallelism (2 gloo ranks, expert 2 x ctx 2) with a capacity that
drops 29% of the choices: the logged figure is, to fp32 rounding, the busiest rank's rows over the mean computed by
hand from the rows each expert ran, as the run's checkpoint saves them (trainer_state.json "moe" router_counts, what
FlexMoE's placer reads). It was computed from the router's choices before the drops: 1.19 logged where the ranks
ran 1.06 (docs/moe.md, Metrics: a dropped choice never reaches a rank)."""

import json
from pathlib import Path

import pytest
from test_training_parity import BASE

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import train

ARGS = [*BASE, "--model.preset=debug-moe", "--parallel.expert=2", "--parallel.ctx=2", "--model.moe.capacity_factor=1.0",
        "--train.steps=1", "--metrics.log_interval=1", "--checkpoint.interval=1"]


def _train(run_dir):
    train(load_config("configs/debug.toml", [*ARGS, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)


def test_rank_load_is_the_rows_the_expert_ranks_ran(tmp_path):
    run_spawned(2, _train, str(tmp_path))
    (line,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "moe_aux_loss" in r]
    assert line["moe_drop_rate"] > 0.1  # the capacity binds
    state = json.loads(next(Path(tmp_path, "checkpoints").glob("step-*/trainer_state.json")).read_text())
    by_hand = 0.0
    for rows in state["moe"]["router_counts"]:  # per MoE layer: the rows each expert ran, experts 0-3 on rank 0
        half = len(rows) // 2
        per_rank = [sum(rows[:half]), sum(rows[half:])]
        by_hand = max(by_hand, max(per_rank) / (sum(per_rank) / 2))
    assert line["expert_rank_load"] == pytest.approx(by_hand, rel=1e-5)
