"""The closing `done:` line says how many steps the run skipped (train.on_nonfinite = skip) and how many times it
rolled back (rollback), as the metrics count them. It said neither: a run whose every step was non-finite ended
with exit 0 and "done: steps 1-4 ..., loss nan -> nan ... the last step's weights in step-00000004/", which are
the untrained initial weights, with no word that no update was applied."""

import re

from longctx.config import load_config
from longctx.train.trainer import train

ARGS = ["--train.steps=4", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--checkpoint.async=true", "--metrics.log_interval=2"]


def _done_line(tmp_path, monkeypatch, fault: str, policy: str) -> str:
    monkeypatch.setenv("LONGCTX_FAULT", fault)
    said: list[str] = []
    train(load_config(None, [*ARGS, f"--train.on_nonfinite={policy}", f"--train.run_dir={tmp_path}"]),
          log=lambda *a, **_: said.append(" ".join(map(str, a))))
    return next(line for line in said if line.startswith("done: "))


def test_a_run_whose_every_step_was_skipped_says_so(tmp_path, monkeypatch):
    line = _done_line(tmp_path, monkeypatch, ",".join(f"nonfinite@{s}" for s in range(1, 5)), "skip")
    assert re.search(r"skipped 4 steps \(not applied", line), line


def test_one_skipped_step_is_counted(tmp_path, monkeypatch):
    line = _done_line(tmp_path, monkeypatch, "nonfinite@3", "skip")
    assert re.search(r"skipped 1 step \(not applied", line), line


def test_a_rollback_is_counted(tmp_path, monkeypatch):
    line = _done_line(tmp_path, monkeypatch, "nonfinite@3", "rollback")
    assert "rolled back 1 time" in line and "skipped" not in line.split(". Its ")[0], line


def test_a_clean_run_says_neither(tmp_path, monkeypatch):
    line = _done_line(tmp_path, monkeypatch, "", "skip")
    assert "skipped" not in line and "rolled back" not in line, line
