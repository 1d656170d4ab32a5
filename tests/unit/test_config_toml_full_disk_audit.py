"""A resume rewrites the run's config.toml (continue_run_files). It was written in place: a full disk (or a kill)
mid-write left it cut short, and the next resume took the settings it lost from the defaults without a word
(train.lr, checkpoint.interval, ...: the saved config is the base a resume builds on, config/resume.py). It is
now written whole or not at all (durable.write_text_durably), the earlier one kept when the write fails."""

import errno
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.train.setup import continue_run_files


def _full_disk_mid_write(monkeypatch):
    write = Path.write_text

    def half(self, text, *args, **kwargs):
        write(self, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)


@pytest.mark.parametrize("changed", [False, True])
def test_a_full_disk_while_a_resume_rewrites_the_config_keeps_the_saved_one(changed, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    saved = load_config(None, ["--train.lr=0.0123", "--checkpoint.interval=7", "--train.steps=30"])
    continue_run_files(run, saved, 0, print)
    text = (run / "config.toml").read_text()
    resumed = load_config(None, ["--train.lr=0.0123", "--checkpoint.interval=7",
                                 f"--train.steps={40 if changed else 30}"])
    _full_disk_mid_write(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        continue_run_files(run, resumed, 10, print)
    monkeypatch.undo()
    assert (run / "config.toml").read_text() == text
    cfg, _ = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={run}"], False)
    assert (cfg.train.lr, cfg.checkpoint.interval) == (0.0123, 7)
