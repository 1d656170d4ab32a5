"""`kill -TERM` of one rank of `longctx train --nproc 2` (helper task blame111).

Failed before: in a run that saves no checkpoint, SIGTERM sent to rank 1's pid alone made the launcher blame rank 0
("rank 0 of 2 failed first (killed by SIGTERM) ... See that rank's output above for its error.", exit 1; or "(exit
code 1)" with rank 0's gloo traceback, "Connection reset by peer", as the cause). It now names rank 1 and SIGTERM,
says the launcher did not send it, and exits 143 as a stopped job does (tests/unit/test_blame111.py: the reasons).
A run that saves checkpoints already stopped every rank on it, after saving (checkpoint.on_signal): exit 75.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.errors import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
STARTS_WITHIN_S = 300  # (set-up: about 15 s on an idle 2-core CPU, over a minute on a loaded one)
ENDS_WITHIN_S = 120


def _rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the ranks a launcher started: its children (Linux's /proc) with a RANK in their environment."""
    children = []
    for listed in Path(f"/proc/{launcher}/task").glob("*/children"):
        children += [int(pid) for pid in listed.read_text().split()]
    found = {}
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found.update({int(e[5:]): pid for e in environ if e.startswith(b"RANK=")})
    return found


def _one_rank_sigtermed(tmp_path, *saves: str) -> tuple[int, str]:
    """A 2-rank training run (head 1 x ctx 2: a ring collective in every layer) told to run for long, and SIGTERM
    sent to rank 1 alone once the steps have begun: the launcher's exit code and stderr."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "longctx", "train", "--nproc", "2", "--parallel.head", "1", "--parallel.ctx",
               "2", "--train.steps", "100000", "--train.seq_len", "64", "--metrics.log_interval", "1",
               "--metrics.plots", "false", "--metrics.progress", "false", "--data.max_docs", "30",
               "--train.eval_interval", "0", f"--train.run_dir={run_dir}", *saves]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_out:
        launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err_out, cwd=ROOT, env=env,
                                    start_new_session=True)  # (a session of its own: killed whole if it hangs)
        try:
            metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + STARTS_WITHIN_S
            while launcher.poll() is None and time.monotonic() < deadline and not (
                    metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
                time.sleep(0.1)  # (the ranks are training: two metrics lines, of steps 1 and 2)
            assert launcher.poll() is None, f"the run ended before the signal:\n{err_file.read_text()}"
            ranks = _rank_pids(launcher.pid)
            assert sorted(ranks) == [0, 1], ranks
            os.kill(ranks[1], signal.SIGTERM)
            code = launcher.wait(timeout=ENDS_WITHIN_S)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    return code, err_file.read_text()


@pytest.mark.slow
def test_sigterm_to_one_rank_alone_names_that_rank_and_exits_143(tmp_path):
    code, err = _one_rank_sigtermed(tmp_path, "--checkpoint.final", "false")  # (saves nothing: no stop on it)
    said = " ".join(err.split())
    assert "longctx train: error: rank 1 of 2 was stopped by SIGTERM, which the launcher did not send" in said, \
        err[-3000:]
    assert "failed first" not in said and "Traceback" not in err, err[-3000:]
    assert code == 128 + int(signal.SIGTERM), (code, err[-3000:])


@pytest.mark.slow
def test_sigterm_to_one_rank_of_a_run_that_saves_stops_every_rank_after_saving(tmp_path):
    code, err = _one_rank_sigtermed(tmp_path, "--checkpoint.interval", "100000")
    assert code == REQUEUE_EXIT_CODE, (code, err[-3000:])
    assert "on SIGTERM" in err and "was stopped by" not in err, err[-3000:]
