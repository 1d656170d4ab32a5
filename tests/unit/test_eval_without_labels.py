"""An evaluation that scores no label (no whole global batch of eval samples in the current stage, or no
labelled token) reports NaN, not a loss of 0.0 (train/trainer.py evaluate: it divided by max(count, 1))."""

import math

from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=1", "--data.max_docs=80", "--train.eval_interval=1",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--train.steps=1"]


def test_an_evaluation_of_no_label_is_nan_not_zero(tmp_path):
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / 'run'}"]), log=lambda *a, **k: None)
    assert trainer.eval_samples is not None and len(trainer.eval_samples) >= 1
    loss = trainer.evaluate()
    assert math.isfinite(loss) and loss > 0  # the evaluation as it runs
    trainer.cfg.train.eval_batches = 0  # nothing scored (as a stage whose global batch outgrows the eval split)
    assert math.isnan(trainer.evaluate())
