"""checkpoint.exit_after_minutes (train/preemption.py, watch.py): at the first step boundary past the
deadline (minutes after the run's set-up began) the run saves that step and exits with code 75, as on a
signal; the ranks stop together at the step any of them passed it; a resume continues exactly; bad
values, and a limit in a run that saves nothing, are refused before work."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, ConfigError, Preempted
from probes import metrics_losses

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--metrics.log_interval=1", "--model.layers=1"]


class _Clock:
    """time.monotonic, moved on by an hour once the run's step `at` is done (at 0: never)."""

    def __init__(self, at: int):
        self.at, self.shift = at, 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.shift


def _trainer_with_clock(cfg, at: int):
    """A Trainer whose time-limit clock jumps past any limit after step `at`."""
    from longctx.train.trainer import Trainer

    clock = _Clock(at)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.clock = clock.monotonic  # (what the limit's check reads; shift 0 until step `at`)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == clock.at:
            clock.shift = 3600.0
        return out

    trainer.step = stepping
    return trainer



def test_past_the_limit_the_step_is_saved_the_run_exits_75_and_a_resume_continues_exactly(tmp_path):
    from longctx.train.trainer import train

    whole = tmp_path / "whole"
    train(load_config(None, [*BASE, f"--train.run_dir={whole}"]), log=lambda *a, **k: None)
    cut = tmp_path / "cut"
    trainer = _trainer_with_clock(load_config(None, [*BASE, f"--train.run_dir={cut}",
                                                     "--checkpoint.exit_after_minutes=60"]), at=2)
    with pytest.raises(Preempted, match=r"saved step 2 on the time limit \(checkpoint.exit_after_minutes 60\)") as e:
        trainer.run()
    assert e.value.exit_code == REQUEUE_EXIT_CODE
    assert sorted(p.name for p in (cut / "checkpoints").glob("step-*")) == ["step-00000002"]
    train(load_config(None, [*BASE, f"--train.run_dir={cut}", "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert metrics_losses(cut) == metrics_losses(whole) and len(metrics_losses(whole)) == 6


def _rank_stops(run_dir: str, at_by_rank: tuple) -> str:
    """On each of 2 ranks: the run's end, with this rank's clock jumping after step at_by_rank[rank]."""
    import torch.distributed as dist

    cfg = load_config(None, [*BASE, f"--train.run_dir={run_dir}", "--checkpoint.exit_after_minutes=60",
                             "--parallel.dp_shard=2"])
    trainer = _trainer_with_clock(cfg, at=at_by_rank[dist.get_rank()])
    try:
        trainer.run()
        return "finished"
    except Preempted as e:
        return str(e).split(";")[0]


def test_the_ranks_stop_together_at_the_step_one_of_them_passed_the_limit(tmp_path):
    """Rank 1's clock passes the limit after step 3, rank 0's never: both save step 3 and stop."""
    from longctx.job.spawn import run_spawned_many

    out = run_spawned_many(2, [("run", _rank_stops, (str(tmp_path / "run"), (0, 3)))])["run"]
    assert out == ["saved step 3 on the time limit (checkpoint.exit_after_minutes 60)"] * 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-00000003"]


def test_the_command_exits_75_once_the_limit_passes(tmp_path):
    """As a user meets it: a limit shorter than the set-up stops at the first step boundary."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--nproc", "1", *BASE,
                        "--checkpoint.exit_after_minutes", "0.0001", f"--train.run_dir={run}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == REQUEUE_EXIT_CODE, r.stderr[-2000:]
    assert r.stdout.count("saved step 1 on the time limit") == 1  # the log's line, and the command's ending:
    assert "stopped: saved step 1 on the time limit" in r.stderr and "--checkpoint.resume auto" in r.stderr
    assert (run / "checkpoints" / "step-00000001").is_dir()


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_limit_that_is_no_number_of_minutes_is_refused(value):
    # (nan and inf: the config reader's own "must be a finite number")
    with pytest.raises(ConfigError, match="checkpoint.exit_after_minutes must be a (number of minutes >= 0|finite)"):
        load_config(None, [f"--checkpoint.exit_after_minutes={value}"])


def test_a_limit_in_a_run_that_saves_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"exit_after_minutes = 30 would stop the run with nothing saved"):
        load_config(None, ["--checkpoint.exit_after_minutes=30", "--checkpoint.final=false"])
    load_config(None, ["--checkpoint.exit_after_minutes=30"])  # (checkpoint.final, the default, saves)
