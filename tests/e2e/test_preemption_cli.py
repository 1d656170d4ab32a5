"""checkpoint.on_signal as a user meets it: `longctx train --nproc 4` (head 2 x ctx 2) with async
saves, SIGTERM sent to the launcher mid-run. The ranks agree on a step, save it (after the async
save in flight), the launcher says "saved step N on SIGTERM" once and exits 75; `--checkpoint.resume
auto` then continues, and its losses equal an uninterrupted run's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.errors import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12  # room: the signal (after step 3) must land before the last step on a fast machine too
RUN = ["train", "--nproc", "4", "--parallel.head", "2", "--parallel.ctx", "2", "--train.steps", str(STEPS),
       "--train.seq_len", "128", "--checkpoint.interval", "3", "--checkpoint.async", "true",
       "--metrics.log_interval", "1", "--metrics.plots", "false", "--metrics.progress", "false",
       "--data.max_docs", "60", "--train.eval_interval", "0"]
# the uninterrupted run is read for its losses only: it saves nothing (its saves at steps 3, 6, 9 and 12 cost
# ~3 s of CPU and ~8 s of wall time here, files no one opened; saves change no loss, the same bits measured,
# and a reference without them cannot share a fault of the saves with the run it checks)
WHOLE = [*RUN[:RUN.index("--checkpoint.interval")], "--checkpoint.interval", "0", "--checkpoint.final", "false",
         *RUN[RUN.index("--checkpoint.async"):]]


def _cmd(*args):
    return [sys.executable, "-m", "longctx", *args]


def _env():
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step" in row:
            out[row["step"]] = row["loss"]
    return out


def _steps_done(run_dir: Path) -> int:
    try:
        return max(_losses(run_dir), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_sigterm_saves_the_step_exits_75_and_resumes_exactly(tmp_path):
    whole = tmp_path / "whole"
    r = subprocess.run(_cmd(*WHOLE, f"--train.run_dir={whole}"), capture_output=True, text=True, cwd=ROOT,
                       env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    cut = tmp_path / "cut"
    p = subprocess.Popen(_cmd(*RUN, f"--train.run_dir={cut}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=_env())
    deadline = time.monotonic() + 300
    while _steps_done(cut) < 3 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, "the run ended before the signal"
    p.send_signal(signal.SIGTERM)  # to the launcher, as Slurm's scancel does
    out, err = p.communicate(timeout=120)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, err[-3000:])
    said = [line for line in err.splitlines() if "saved step" in line and "on SIGTERM" in line]
    assert len(said) == 1, err[-3000:]  # once, from the launcher, for all ranks
    stopped = int(said[0].split("saved step ")[1].split()[0])
    assert 3 <= stopped < STEPS
    assert (cut / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert _steps_done(cut) == stopped  # it stopped at the step it saved

    resumed = subprocess.run(_cmd("train", f"--train.run_dir={cut}", "--checkpoint.resume", "auto", "--nproc", "4"),
                             capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _losses(whole), _losses(cut)
    assert sorted(got) == list(range(1, STEPS + 1))
    diff = max(abs(got[s] - want[s]) for s in range(stopped + 1, STEPS + 1))
    print(f"SIGTERM at step {stopped}: exit {p.returncode}; steps {stopped + 1}-{STEPS} after resume within "
          f"{diff:.1e} of the uninterrupted run")
    assert diff <= 1e-5
