"""The training phase's count inside a step (train/step_progress.py) on real gloo ranks: FSDP2 over 2 data ranks,
full recomputation and 2 micro-batches per step. Rank 0's count moves block by block and micro-batch by micro-batch,
never goes back, stays below each step's whole until the step ends and is then exactly whole; rank 1, whose phase
no line reads, hooks nothing."""

from __future__ import annotations

import os

from longctx.job.spawn import run_spawned

BASE = ["--model.layers=2", "--train.seq_len=64", "--train.global_batch=4", "--train.grad_accum=2",
        "--memory.recompute=full", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
        "--metrics.progress=false", "--train.device=cpu", "--checkpoint.final=false", "--train.steps=2",
        "--parallel.timeout_s=60"]


def _rank(run_dir: str):
    from longctx.config import load_config
    from longctx.train.hooks import StepHook
    from longctx.train.trainer import Trainer
    from phase_spy import record_phases

    os.environ["LONGCTX_PROGRESS_S"] = "1000"  # (lines on, none due in the test)
    os.environ["LONGCTX_FAULT"] = ""
    made = record_phases()
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    hooked: list[int] = []

    class Hooked(StepHook):
        def step_start(self, step: int) -> None:
            hooked.append(len(trainer.step_counts.handles))

    trainer.hooks.hooks.append(Hooked())
    trainer.run()
    return [p.values for p in made if p.what == "training"], hooked


def test_rank_0_counts_its_steps_block_by_block_and_rank_1_hooks_nothing(tmp_path):
    (values0, hooked0), (values1, hooked1) = run_spawned(2, _rank, str(tmp_path / "run"), timeout=300)
    assert hooked0 == [2, 2] and hooked1 == [0, 0]  # (one hook per block on rank 0; none on rank 1)
    assert values1 == []  # (rank 1's phase is quiet: not a Phase the test records)
    (values,) = values0
    assert values == sorted(values) and values[0] == 0 and values[-1] == 2, values
    assert 1 in values, values  # (the first step's end: exactly whole)
    for k in (0, 1):
        inside = {v for v in values if k < v < k + 1}
        # 2 micro-batches x (2 forwards + 2 gradients) of counting, the second micro-batch from about half on
        assert len(inside) >= 6, values
        assert any(k + 0.45 <= v <= k + 0.5 for v in inside), values
