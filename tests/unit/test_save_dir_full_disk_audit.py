"""A full disk already where a save makes its temporary directory (mkdir fails with ENOSPC, as it does on a full
ext4): the OSError escaped the save raw, so checkpoint.on_save_error was bypassed (under `warn` the run crashed
instead of training on) and `stop` ended without the failed-save message (the bytes needed, the checkpoint kept).
LONGCTX_FAULT=enospc fails a save only inside its directory, so tests/unit/test_save_errors.py did not see it."""

import errno
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.train.trainer import Trainer


def _full_disk_at_the_save_of(step, monkeypatch):
    mkdir = Path.mkdir

    def full(self, *args, **kwargs):
        if self.name.startswith(f".tmp-step-{step:08d}"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)


def _trainer(tmp_path, policy):
    return Trainer(load_config(None, [
        "--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", f"--checkpoint.on_save_error={policy}",
        f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)


def test_warn_trains_on_past_a_full_disk_at_the_save_directory(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "warn")
    _full_disk_at_the_save_of(4, monkeypatch)
    assert len(trainer.run().losses) == 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000006"]


def test_stop_says_what_failed_and_what_is_kept(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "stop")
    _full_disk_at_the_save_of(4, monkeypatch)
    with pytest.raises(CheckpointError, match="step 4 could not be written.*step-00000002, is intact"):
        trainer.run()
