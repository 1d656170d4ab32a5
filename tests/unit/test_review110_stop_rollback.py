"""A signal whose stop reads back a bad step (train.on_nonfinite = rollback) rolls back inside stop_on_signal; the
steps the rollback kept that no metrics line covered yet (between the last line and the checkpoint it went back
to) were then in no record's loss_mean, as the loop's own rollback left them before _log_kept_steps: the stop now
writes their line too (review110)."""

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


def test_a_stop_that_rolls_back_logs_the_kept_steps_no_line_covered(tmp_path, monkeypatch):
    # step 7 bad and SIGTERM in step 7 (neither a log nor a save step: its figures are read by the stop): back to
    # step 6's checkpoint; steps 5-6 were trained and kept, the last line (step 4) covered 2-4
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@7")
    trainer = Trainer(load_config(None, [*ARGS, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = stepping
    with pytest.raises(Preempted, match="saved step 7 on SIGTERM"):
        trainer.run()
    assert trainer.rollbacks == 1
    records = _train_records(tmp_path)
    assert [(r["step"], r["interval_steps"]) for r in records] == [(1, 1), (4, 3), (6, 2)]
    # a resume goes on after the rolled-back window: every kept step in exactly one line's interval
    monkeypatch.delenv("LONGCTX_FAULT")
    Trainer(load_config(None, [*ARGS, f"--train.run_dir={tmp_path}", "--checkpoint.resume=auto"]),
            log=lambda *a, **k: None).run()
    assert [(r["step"], r["interval_steps"]) for r in _train_records(tmp_path)] == \
        [(1, 1), (4, 3), (6, 2), (8, 1), (10, 2)]
