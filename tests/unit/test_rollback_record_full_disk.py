"""A rollback whose record (rollbacks.jsonl) cannot be written, as on a full disk, stops the run with a message that
says what happened and how to go on; it once ended in a raw OSError traceback (and, under --nproc N, in rank 0's
traceback only, while the others went on into the next step)."""

import errno

import pytest

from longctx.config import load_config
from longctx.errors import TrainingError
from longctx.train import rollback
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--metrics.log_interval=1", "--train.on_nonfinite=rollback"]


def test_a_rollback_that_cannot_be_recorded_stops_the_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@5")

    def full(*_args, **_kwargs):  # (as its write to a full disk raises)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rollback, "record_rollback", full)
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    with pytest.raises(TrainingError, match=r"at step 5: the run rolled back to step-00000004, but could not record it "
                                            r"in .*rollbacks.jsonl \(No space left on device\); the run stops.*"
                                            r"--checkpoint.resume auto"):
        trainer.run()
