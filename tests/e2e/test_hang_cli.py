"""The hang watchdog as a user meets it: `longctx train --nproc 4` (head 2 x ctx 2) with rank 1 stuck in
step 3's forward (LONGCTX_FAULT=hang@1:3) and --parallel.timeout_s 10. The job must end within 90 s
of the hang, with the watchdog's exit code, naming rank 1 and its phase once (the others waiting
in a collective), printing the ranks' stacks, and leaving no process behind."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.job.watchdog import HANG_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]


def _steps_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(x).get("step", 0) for x in lines if x.strip()), default=0)
    except (OSError, ValueError):
        return 0


def _processes_naming(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if text in line and "ps -eo" not in line]


@pytest.mark.slow
def test_a_hung_rank_is_named_with_its_phase_and_nothing_is_left_running(tmp_path):
    run_dir = tmp_path / "hang"
    cmd = [sys.executable, "-m", "longctx", "train", "--nproc", "4", "--parallel.head", "2", "--parallel.ctx", "2",
           "--train.steps", "6", "--train.seq_len", "128", "--parallel.timeout_s", "10", "--metrics.log_interval", "1",
           "--metrics.plots", "false", "--metrics.progress", "false", "--data.max_docs", "60",
           "--train.eval_interval", "0", f"--train.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LONGCTX_FAULT": "hang@1:3"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.monotonic() + 300
    while _steps_done(run_dir) < 2 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    hung_from = time.monotonic()  # step 2 is logged: step 3, where rank 1 hangs, starts now
    _, err = p.communicate(timeout=300)
    took = time.monotonic() - hung_from
    assert p.returncode == HANG_EXIT_CODE, (p.returncode, err[-3000:])
    assert took < 90, took
    flat = " ".join(err.split())
    assert flat.count("rank 1 of 4 hung at step 3 (forward)") == 1, err[-3000:]
    for rank in (0, 2, 3):
        assert f"rank {rank}: step 3, forward, waiting in a collective" in flat
    assert "rank 1: step 3, forward, not in a collective at faults.py" in flat
    assert "--- rank 1 (hung) ---" in err and "in hang_forever" in err  # its Python stack
    assert "out-of-memory" not in err
    time.sleep(1)
    assert _processes_naming(str(run_dir)) == []  # no rank left running
    print(f"hang@1:3 with timeout 10 s: exit {p.returncode} {took:.0f} s after step 2 was logged")
