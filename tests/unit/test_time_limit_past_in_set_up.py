"""A resumed run whose checkpoint.exit_after_minutes has already passed when its set-up ends (a set-up longer than the
limit) still trains a step and saves it before it stops, exit 75, as before the set-up's signals were caught: the
stop before any step is for a signal that came during set-up. Stopped there too, each requeued job spent its set-up
and trained nothing, requeued without end ("the time limit ... came during set-up")."""

import time

import pytest

from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, Preempted
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2"]


def test_a_limit_passed_during_a_resumed_set_up_still_trains_a_step(tmp_path):
    args = [*BASE, f"--train.run_dir={tmp_path}"]
    Trainer(load_config(None, [*args, "--train.steps=2"]), log=lambda *a, **k: None).run()
    trainer = Trainer(load_config(None, [*args, "--checkpoint.resume=auto", "--checkpoint.exit_after_minutes=1"]),
                      log=lambda *a, **k: None)
    trainer.clock = lambda: time.monotonic() + 3600.0  # (the set-up took longer than the limit)
    with pytest.raises(Preempted, match=r"saved step 3 on the time limit") as e:
        trainer.run()
    assert e.value.exit_code == REQUEUE_EXIT_CODE
    assert (tmp_path / "checkpoints" / "step-00000003").is_dir()
