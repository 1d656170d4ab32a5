"""A stop on a signal whose read-back finds a bad step (train.on_nonfinite = rollback) saves the rolled-back
state. In a staged run whose checkpoint rolled back to is in an earlier stage, that save recorded the later
stage's length as trained (manifest trained_positions: what `longctx generate` trusts the weights with), though
its weights are the earlier checkpoint's. A rollback that goes on in the later stage still records its length
at the next save (the steps after it train there)."""

import json
import os
import signal

from longctx.config import load_config
from longctx.errors import Preempted
from longctx.train.trainer import Trainer

BASE = ["--train.stages=64:2,128:4", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2", "--metrics.log_interval=10", "--train.on_nonfinite=rollback"]


def _trained(root, step: int) -> int:
    return json.loads((root / f"step-{step:08d}" / "manifest.json").read_text()).get("trained_positions")


def _trainer(tmp_path, monkeypatch, signal_at: int | None = None) -> Trainer:
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = stepping
    return trainer


def test_a_stop_that_rolls_back_to_an_earlier_stage_records_that_checkpoints_positions(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, monkeypatch, signal_at=3)  # step 3 (stage 2) is bad; read at the stop
    try:
        trainer.run()
        raise AssertionError("the run did not stop on the signal")
    except Preempted as e:
        assert "saved step 3 on SIGTERM" in str(e)
    root = tmp_path / "checkpoints"
    assert _trained(root, 2) == 64
    assert _trained(root, 3) == 64  # step 2's weights, rolled back to: they never trained at 128 (was 128)


def test_a_rollback_that_goes_on_in_the_later_stage_records_it_at_the_next_save(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, monkeypatch)  # bad step 3 read at the save of step 4: back to step 2, on at 4
    trainer.run()
    assert trainer.rollbacks == 1
    root = tmp_path / "checkpoints"
    assert _trained(root, 4) == 128 and _trained(root, 6) == 128
