"""train.on_nonfinite = rollback when training from a checkpoint keeps failing (every step after it bad, as in
a run that diverges from there): the run rolled back to that checkpoint at every bad step until train.steps,
discarding all of it, and then ended like a good run (no error, a normal done line) with the checkpoint's
weights. It now stops with a TrainingError after rollback.REPEAT_LIMIT rollbacks in a row to one checkpoint;
rollbacks to a newer checkpoint each start the count again."""

import pytest

from longctx.config import load_config
from longctx.errors import TrainingError
from longctx.train.rollback import REPEAT_LIMIT
from longctx.train.trainer import Trainer

BASE = ["--train.steps=20", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=4", "--metrics.log_interval=1", "--train.on_nonfinite=rollback"]


def _bad_at(trainer, bad):
    """Every step `bad(step)` names has a NaN loss (each time it runs)."""
    step = trainer.step

    def stepping(s):
        hook = trainer.model.register_forward_hook(lambda m, a, loss: loss * float("nan")) if bad(s) else None
        try:
            return step(s)
        finally:
            if hook is not None:
                hook.remove()

    trainer.step = stepping


def test_a_run_that_keeps_failing_after_one_checkpoint_stops(tmp_path):
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    _bad_at(trainer, lambda s: s >= 5)
    with pytest.raises(TrainingError, match=f"rolled back to step-00000004 {REPEAT_LIMIT} times in a row"):
        trainer.run()
    assert trainer.rollbacks == REPEAT_LIMIT


def test_rollbacks_to_newer_checkpoints_each_start_the_count_again(tmp_path):
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    _bad_at(trainer, lambda s: s in (5, 6, 9, 10, 13, 14, 17, 18))  # two in a row after each checkpoint
    assert len(trainer.run().losses) >= 20 - 4
    assert trainer.rollbacks == 8
