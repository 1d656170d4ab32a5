"""checkpoint.on_save_error = warn when the save that fails is the run's last (train/saves.py): no later save
tries again, so the run stops with the error (a non-zero exit) instead of ending with exit 0, "Training goes on"
and the last steps' weights nowhere on disk, a run a batch script takes for finished and never resumes. Its
resume trains the lost steps again and saves the last one."""

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import LATEST, CheckpointError
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=3", "--checkpoint.on_save_error=warn", "--checkpoint.keep=5"]


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_failed_last_save_under_warn_stops_the_run_and_its_resume_saves_it(async_save, tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")  # the second save, step 6's: the run's last
    args = [*BASE, f"--checkpoint.async={async_save}", f"--train.run_dir={tmp_path}"]
    trainer = Trainer(load_config(None, args), log=lambda *a, **k: None)
    with pytest.raises(CheckpointError, match=r"step 6 could not be written.*The run stops \(step 6 is its last"):
        trainer.run()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003"]
    assert (root / LATEST).read_text().strip() == "step-00000003"

    monkeypatch.delenv("LONGCTX_FAULT")
    resumed = Trainer(load_config(None, [*args, "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert resumed.start_step == 3 and len(resumed.run().losses) == 3
    assert (root / LATEST).read_text().strip() == "step-00000006"
