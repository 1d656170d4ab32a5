"""A resume of the checkpoint a run rolled back to, into another run directory (--checkpoint.resume PATH with a
new --train.run_dir), continues after the bad step like a resume in the run's own directory: the rollback's
record (rollbacks.jsonl) lies beside that checkpoint, not in the new run's checkpoint directory, where alone it
was looked for, so the resume trained again on the skipped window that led to the bad step."""

import pytest

from longctx.config import load_config
from longctx.train.trainer import Trainer

ARGS = ["--train.steps=4", "--train.seq_len=64", "--train.global_batch=2", "--train.eval_interval=0",
        "--data.max_docs=40", "--metrics.progress=false", "--metrics.plots=false", "--model.layers=2",
        "--train.device=cpu", "--train.on_nonfinite=rollback", "--checkpoint.interval=2", "--checkpoint.keep=5"]


def _losses(run_dir, *extra):
    cfg = load_config(overrides=[*ARGS, f"--train.run_dir={run_dir}", *extra])
    return Trainer(cfg, log=lambda *a, **k: None).run().losses


def test_a_resume_into_another_directory_does_not_replay_the_rolled_back_window(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    first = _losses(tmp_path / "a")  # step 3 rolled back to step 2; step 4 trained on its own data
    monkeypatch.setenv("LONGCTX_FAULT", "")
    resumed = _losses(tmp_path / "b", f"--checkpoint.resume={tmp_path}/a/checkpoints/step-00000002")
    assert len(first) == 4 and first[2] != first[2]  # (NaN at the bad step)
    assert resumed == pytest.approx(first[3:], abs=1e-6)  # step 4 alone, as the run had it
