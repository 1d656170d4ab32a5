"""A run that fails with an async save in flight (train.on_nonfinite = stop at a bad step read right after a
save, a full disk at a metrics line, Ctrl-C): the exception left the save's commit to the background thread, a
daemon the exiting process killed, so the checkpoint stayed a .tmp-* directory that the next start swept away
(`longctx train` stopped at step 5 left no checkpoint at all; its step-4 save was lost). The save in flight is
now committed before the error propagates."""

import time

import pytest

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.errors import TrainingError
from longctx.train.trainer import Trainer

BASE = ["--train.steps=8", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=4", "--checkpoint.async=true", "--metrics.log_interval=1"]


def _slow_commits(monkeypatch):
    commit = CheckpointManager._commit

    def slow(self, *args, **kwargs):
        time.sleep(1.0)  # (a large checkpoint's commit outlasts the next step)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_commit", slow)


def test_a_stop_on_a_bad_step_commits_the_save_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@5")
    _slow_commits(monkeypatch)
    trainer = Trainer(load_config(None, [*BASE, "--train.on_nonfinite=stop", f"--train.run_dir={tmp_path}"]),
                      log=lambda *a, **k: None)
    with pytest.raises(TrainingError, match="at step 5"):
        trainer.run()
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "step-00000004" / "manifest.json").is_file()
    assert (checkpoints / "latest").read_text().strip() == "step-00000004"
    assert not list(checkpoints.glob(".tmp-*"))


def test_a_crash_in_a_metrics_write_commits_the_save_in_flight(tmp_path, monkeypatch):
    _slow_commits(monkeypatch)
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    line = trainer.metrics.line

    def full_disk(step, *args, **kwargs):
        if step == 5:
            raise OSError(28, "No space left on device")
        return line(step, *args, **kwargs)

    trainer.metrics.line = full_disk
    with pytest.raises(OSError, match="No space left"):
        trainer.run()
    assert (tmp_path / "checkpoints" / "step-00000004" / "manifest.json").is_file()
