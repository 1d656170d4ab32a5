"""The training bar's count (and so its percentage and time left) after a resume and after a rollback. A run
resumed at step 6 of 8 drew `1/8 ... 2/8 (25%)` and an ETA for 7 more steps when it had finished; a rollback found
two steps after the bad one counted the step run again twice (`9step` of 8: tqdm drops the bar past its total).
The bar is tqdm's, drawn only on a terminal: on_terminal is made true and stderr captured."""

import re

import pytest

import longctx.progress
from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--train.device=cpu", "--checkpoint.interval=3"]


def _counts(text: str) -> list[tuple[int, int]]:
    """Every `done/total` the bar drew."""
    return [(int(a), int(b)) for a, b in re.findall(r"\| *(\d+)/(\d+) \[", text)]


def _run(args, capsys) -> list[tuple[int, int]]:
    capsys.readouterr()
    Trainer(load_config(None, [*BASE, *args]), log=lambda *a, **k: None).run()
    return _counts(capsys.readouterr().err)


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    monkeypatch.setenv("LONGCTX_FAULT", "")


def test_a_resumed_runs_bar_starts_at_the_resumed_step(tmp_path, capsys, terminal):
    run = [f"--train.run_dir={tmp_path / 'r'}", "--metrics.log_interval=1"]
    assert _run([*run, "--train.steps=6"], capsys)[-1] == (6, 6)
    counts = _run([*run, "--train.steps=8", "--checkpoint.resume=auto"], capsys)
    assert counts[0][0] >= 6 and counts[-1] == (8, 8), counts


def test_a_rollback_counts_each_step_once(tmp_path, capsys, terminal, monkeypatch):
    # bad step 4, read at step 6 (saves every 3, a line every 6): step 5 ran before the read and runs again
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@4")
    counts = _run([f"--train.run_dir={tmp_path / 'r'}", "--metrics.log_interval=6", "--train.on_nonfinite=rollback",
                   "--train.steps=8"], capsys)
    assert counts and counts[-1] == (8, 8) and all(done <= total for done, total in counts), counts
