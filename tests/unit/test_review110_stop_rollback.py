"""A stop on a signal writes a line for the steps no metrics line covered yet (review110): after a rollback its
read-back found (train.on_nonfinite = rollback), the kept steps up to the checkpoint it went back to; without one,
the steps since the last line up to the step it saves. Both were in no record's loss_mean (trainer.py
_log_uncovered)."""

import json
import os
import signal

import pytest

from longctx.config import load_config
from longctx.errors import Preempted
from longctx.train.trainer import Trainer

ARGS = ["--train.steps=10", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--metrics.log_interval=4", "--checkpoint.interval=2", "--train.on_nonfinite=rollback"]


def _train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def _stopped_in_step_7(run_dir) -> Trainer:
    """A run whose step 7 ends with SIGTERM to this process (the stop reads the step's figures back and saves)."""
    trainer = Trainer(load_config(None, [*ARGS, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = stepping
    with pytest.raises(Preempted, match="saved step 7 on SIGTERM"):
        trainer.run()
    return trainer


def test_a_stop_that_rolls_back_logs_the_kept_steps_no_line_covered(tmp_path, monkeypatch):
    # step 7 bad and SIGTERM in step 7 (neither a log nor a save step: its figures are read by the stop): back to
    # step 6's checkpoint; steps 5-6 were trained and kept, the last line (step 4) covered 2-4
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@7")
    trainer = _stopped_in_step_7(tmp_path)
    assert trainer.rollbacks == 1
    records = _train_records(tmp_path)
    assert [(r["step"], r["interval_steps"]) for r in records] == [(1, 1), (4, 3), (6, 2)]
    # a resume goes on after the rolled-back window: every kept step in exactly one line's interval
    monkeypatch.delenv("LONGCTX_FAULT")
    Trainer(load_config(None, [*ARGS, f"--train.run_dir={tmp_path}", "--checkpoint.resume=auto"]),
            log=lambda *a, **k: None).run()
    assert [(r["step"], r["interval_steps"]) for r in _train_records(tmp_path)] == \
        [(1, 1), (4, 3), (6, 2), (8, 1), (10, 2)]


def test_a_plain_stop_logs_the_steps_since_the_last_line(tmp_path):
    # SIGTERM in step 7, no bad step: steps 5-7 trained and saved (step 7 on the signal), the last line at step 4;
    # they were in no line (with log_interval 100 a preemption could drop 99 steps from the loss curve)
    _stopped_in_step_7(tmp_path)
    records = _train_records(tmp_path)
    assert [(r["step"], r["interval_steps"]) for r in records] == [(1, 1), (4, 3), (7, 3)]
    assert records[-1]["loss_mean"] > 0 and records[-1]["loss"] > 0
    Trainer(load_config(None, [*ARGS, f"--train.run_dir={tmp_path}", "--checkpoint.resume=auto"]),
            log=lambda *a, **k: None).run()
    assert [(r["step"], r["interval_steps"]) for r in _train_records(tmp_path)] == \
        [(1, 1), (4, 3), (7, 3), (8, 1), (10, 2)]

