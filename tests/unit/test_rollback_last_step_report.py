"""A rollback at the run's last step (train.on_nonfinite = rollback, LONGCTX_FAULT=nonfinite@6 of train.steps 6):
no step trains after it, so the run ends with the checkpoint's weights (step 4). What it says must match that:
the rollback line names no step 7, and the done line's last loss, evaluation and weights are step 4's, not the
discarded step 6's NaN loss, step 5's evaluation of discarded weights, or a checkpoint of step 6 never saved."""

import json

from longctx.config import load_config
from longctx.train.trainer import Trainer

ARGS = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=5",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=4",
        "--train.on_nonfinite=rollback", "--train.steps=6", "--metrics.log_interval=1"]


def test_a_rollback_of_the_last_step_says_the_run_ends_with_the_checkpoints_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@6")
    logs: list[str] = []
    run = tmp_path / "run"
    Trainer(load_config(None, [*ARGS, f"--train.run_dir={run}"]), log=lambda *a, **_: logs.append(" ".join(
        map(str, a)))).run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert sorted(train) == [1, 2, 3, 4, 5]  # (step 6 gets no line: said, not changed)
    assert any(r["kind"] == "eval" and r["step"] == 5 for r in records)  # an evaluation of discarded weights

    rollback = next(line for line in logs if "rolled back to the checkpoint of step 4" in line)
    assert "goes on at step 7" not in rollback
    assert "the run ends with the weights of step 4" in rollback

    done = next(line for line in logs if line.startswith("done:"))
    assert f"-> {train[4]:.4f} (step 4's: steps 5-6 rolled back)" in done
    assert "nan" not in done and "eval loss" not in done  # (the only evaluation, step 5's, was rolled back)
    assert f"{run / 'checkpoints' / 'step-00000004'}/" in done
    assert (run / "checkpoints" / "latest").exists()
