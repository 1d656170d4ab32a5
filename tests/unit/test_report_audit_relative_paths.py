"""`longctx report RUN` from another working directory than the one `longctx train` ran in: a relative
metrics.file or checkpoint.dir in the run's config.toml is relative to the training directory (found from
train.run_dir, or the default runs/<name>), not the report's; where it cannot be found, the error says why."""

import json
from pathlib import Path

import pytest

from longctx.errors import UserError
from longctx.train.report import rolled_back_steps, write_plots


def _run(top: Path, run_dir: str | None, name: str = "x") -> Path:
    run = top / "runs" / name
    run.mkdir(parents=True)
    (top / "logs").mkdir()
    (top / "ck").mkdir()
    train = f'[train]\nrun_dir = "{run_dir}"\n' if run_dir is not None else ""
    (run / "config.toml").write_text(f'{train}[metrics]\nfile = "logs/m.jsonl"\n[checkpoint]\ndir = "ck"\n')
    rec = {"kind": "train", "loss": 2.0, "tokens_per_s": 10.0, "memory_gib": 1.0}
    (top / "logs" / "m.jsonl").write_text("".join(json.dumps({**rec, "step": s}) + "\n" for s in (1, 2, 3)))
    (top / "ck" / "rollbacks.jsonl").write_text(json.dumps({"skipped_steps": [2, 3]}) + "\n")
    return run


@pytest.mark.parametrize("run_dir", ["runs/x", "./runs/x", None])  # (None: the default runs/<time>-<preset>)
def test_report_finds_relative_metrics_file_and_rollbacks_from_elsewhere(tmp_path, monkeypatch, run_dir):
    run = _run(tmp_path / "top", run_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    written = write_plots(run, say=lambda *a: None)
    assert [p.name for p in written] == ["loss.png", "throughput.png"]
    assert rolled_back_steps(run) == [(2, 3)]


def test_a_relative_metrics_file_that_cannot_be_found_says_why(tmp_path, monkeypatch):
    run = _run(tmp_path / "top", "/somewhere/else/x")  # (an absolute run_dir: the training directory is unknown)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="relative to the directory `longctx train` ran in"):
        write_plots(run, say=lambda *a: None)


def test_rollbacks_recorded_in_both_checkpoint_directories_are_shaded(tmp_path):
    """A run that rolled back under <run>/checkpoints, then was resumed with --checkpoint.dir elsewhere and
    rolled back there: both windows are the run's (the old code read the first record file only)."""
    run, other = tmp_path / "run", tmp_path / "fast_ck"
    (run / "checkpoints").mkdir(parents=True)
    other.mkdir()
    (run / "config.toml").write_text(f'[checkpoint]\ndir = "{other}"\n')
    (run / "checkpoints" / "rollbacks.jsonl").write_text(json.dumps({"skipped_steps": [5, 7]}) + "\n")
    (other / "rollbacks.jsonl").write_text(json.dumps({"skipped_steps": [21, 22]}) + "\n")
    assert rolled_back_steps(run) == [(5, 7), (21, 22)]
