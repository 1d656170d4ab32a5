"""A scheduler's user signal sent to the launcher of `longctx train --nproc N` (Slurm's `--signal=USR1@T`
signals the task that runs it; checkpoint.on_signal's default includes SIGUSR1): the launcher passes it on
to its ranks, which save the step and stop, and the command exits with the requeue code. torchrun catches
only SIGTERM, SIGINT, SIGHUP and SIGQUIT itself: SIGUSR1 ended the launcher at once (exit -10), its ranks
with it, with no checkpoint and no message."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.errors import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sigusr1_to_the_launcher_saves_and_exits_75(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "longctx", "train", "--nproc", "2", "--parallel.head", "1", "--parallel.ctx", "2",
           "--train.steps", "200", "--train.seq_len", "64", "--checkpoint.interval", "100",
           "--metrics.log_interval", "1", "--metrics.plots", "false", "--metrics.progress", "false",
           "--data.max_docs", "30", "--train.eval_interval", "0", f"--train.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    assert p.poll() is None, "the run ended before the signal"
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=120)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, err[-3000:])
    said = [line for line in err.splitlines() if "saved step" in line and "on SIGUSR1" in line]
    assert len(said) == 1, err[-3000:]
    stopped = int(said[0].split("saved step ")[1].split()[0])
    assert 1 <= stopped < 200 and (run_dir / "checkpoints" / f"step-{stopped:08d}").is_dir()
