"""checkpoint.exit_after_minutes against what a scheduler's wall-clock limit needs (train/preemption.py):
the limit counts from the `longctx train` command's start (its preflight's data build included), not
from the Trainer's set-up; a limit passed at the last step finishes the run (exit 0); at a save step
with async saves the step is saved once and committed before the stop; a bad step found by the stop's
read is rolled back and the state the run goes on from is saved, and its resume continues exactly."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, Preempted
from probes import metrics_losses

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--metrics.log_interval=1", "--model.layers=1"]
STARTED_ENV = "LONGCTX_COMMAND_STARTED"  # (train/preemption.py's STARTED_ENV, spelled out: what a rank inherits)


def _quiet(*_a, **_k):
    pass


def _trainer(args: list[str], jump_after: int = 0, log=_quiet):
    """A Trainer whose limit's clock jumps by two hours once step `jump_after` is done (0: never)."""
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*BASE, *args]), log=log)
    shift = [0.0]
    trainer.clock = lambda: time.monotonic() + shift[0]
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == jump_after:
            shift[0] = 7200.0
        return out

    trainer.step = stepping
    return trainer



def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def test_the_limit_counts_from_the_commands_start_not_the_trainers_set_up(tmp_path, monkeypatch):
    """A command that began two hours ago (its preflight built a large corpus's store) is past a limit of
    60 minutes at its first step: it stopped only 60 minutes after the Trainer's set-up, past a scheduler's
    kill, with everything since the last save lost."""
    monkeypatch.setenv(STARTED_ENV, repr(time.time() - 7200))
    trainer = _trainer([f"--train.run_dir={tmp_path}", "--checkpoint.exit_after_minutes=60"])
    with pytest.raises(Preempted, match=r"saved step 1 on the time limit \(checkpoint.exit_after_minutes 60\)"):
        trainer.run()
    assert _steps(tmp_path) == ["step-00000001"]


def test_the_command_counts_its_own_start_and_leaves_no_start_behind(monkeypatch):
    from longctx.train.preemption import STARTED_ENV as name
    from longctx.train.preemption import command_age, command_clock, process_started

    assert name == STARTED_ENV
    monkeypatch.delenv(STARTED_ENV, raising=False)
    assert command_age() == 0.0  # a library caller's Trainer: from its own set-up
    assert process_started() <= time.time()
    with command_clock():
        assert command_age() >= 0.0 and float(os.environ[STARTED_ENV]) <= time.time()
    assert command_age() == 0.0  # (not left to a later Trainer in this process)


def test_the_interpreters_start_counts_in_the_command(tmp_path):
    """As a user meets it: the time before the command's set-up (here a sleep before `longctx train` runs, as
    a preflight's data build) counts, so a limit shorter than it stops at the first step boundary."""
    run = tmp_path / "run"
    code = ("import sys, time; time.sleep(12); from longctx.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "train", "--nproc", "1", *BASE, "--train.steps=100000",
                        "--checkpoint.exit_after_minutes", "0.15", f"--train.run_dir={run}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == REQUEUE_EXIT_CODE, r.stderr[-2000:]
    assert "stopped: saved step 1 on the time limit (checkpoint.exit_after_minutes 0.15)" in r.stderr
    assert _steps(run) == ["step-00000001"]


def test_a_limit_passed_at_the_last_step_finishes_the_run(tmp_path):
    """The run is complete: its last step is saved as usual and no preemption is claimed (exit 0, no requeue)."""
    trainer = _trainer([f"--train.run_dir={tmp_path}", "--checkpoint.exit_after_minutes=60"], jump_after=6)
    assert len(trainer.run().losses) == 6
    assert _steps(tmp_path) == ["step-00000006"]


def test_a_limit_at_an_async_save_step_saves_it_once_and_commits_it(tmp_path):
    """Step 4 is a periodic save's, in flight when the limit stops the run: it is not saved twice, it is
    complete and `latest` names it when the stop returns, and checkpoint.keep 1 pruned step 2."""
    lines = []
    trainer = _trainer([f"--train.run_dir={tmp_path}", "--checkpoint.exit_after_minutes=60", "--checkpoint.interval=2",
                        "--checkpoint.async=true", "--checkpoint.keep=1"], jump_after=4,
                       log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    with pytest.raises(Preempted, match="saved step 4 on the time limit"):
        trainer.run()
    assert sum("checkpoint: saved step 4 " in line for line in lines) == 1
    assert _steps(tmp_path) == ["step-00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert (tmp_path / "checkpoints" / "step-00000004" / "manifest.json").is_file()


def test_a_bad_step_read_at_the_stop_is_rolled_back_and_the_resume_continues_exactly(tmp_path, monkeypatch):
    """train.on_nonfinite = rollback, step 3 non-finite and not yet read (no metrics line, no save at it)
    when the limit stops the run: the stop's read rolls back to step 2 and saves the state the run goes on
    from; the resume's losses are those of a run that was never stopped."""
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    args = ["--train.on_nonfinite=rollback", "--checkpoint.interval=2", "--metrics.log_interval=5"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _trainer([*args, f"--train.run_dir={whole}"]).run()
    trainer = _trainer([*args, f"--train.run_dir={cut}", "--checkpoint.exit_after_minutes=60"], jump_after=3)
    with pytest.raises(Preempted, match="saved step 3 on the time limit"):
        trainer.run()
    assert _steps(cut)[-1] == "step-00000003"
    _trainer([*args, f"--train.run_dir={cut}", "--checkpoint.resume=auto"]).run()
    # (2: the line of the steps the rollback kept, which no line covered yet, written at the rollback in either)
    assert metrics_losses(cut) == metrics_losses(whole) and sorted(metrics_losses(whole)) == [1, 2, 5, 6]
