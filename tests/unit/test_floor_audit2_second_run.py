"""A second run started on a run directory while the first still trains (train/run_lock.py): refused before it
touches anything. Unrefused, its start swept the first's save in flight as a killed save's leftovers and moved the
first's newer metrics aside under it (the first's later lines went to a file no longer in the directory), and the
two then committed checkpoints and `latest` over each other's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, ConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--metrics.log_interval=1",
        "--model.layers=1", "--checkpoint.interval=5"]


def _steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_second_run_on_a_live_run_directory_is_refused_and_the_first_loses_nothing(tmp_path):
    from longctx.train.trainer import Trainer

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "longctx", "train", "--nproc", "1", *BASE,
                              "--train.steps=100000", f"--train.run_dir={run_dir}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_steps_logged(run_dir)) < 12 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.stdout.read()
        cfg = load_config(None, [*BASE, "--train.steps=100000", f"--train.run_dir={run_dir}",
                                 "--checkpoint.resume=auto"])
        with pytest.raises(ConfigError, match="in use by another `longctx train`"):
            Trainer(cfg, log=lambda *a, **k: None)
        # another run directory saving into the first's checkpoint directory: refused too
        into = load_config(None, [*BASE, "--train.steps=100000", f"--train.run_dir={tmp_path / 'other'}",
                                  f"--checkpoint.dir={run_dir / 'checkpoints'}", "--checkpoint.resume=auto"])
        with pytest.raises(ConfigError, match="checkpoint.dir .* is in use by another `longctx train`"):
            Trainer(into, log=lambda *a, **k: None)
        first.send_signal(signal.SIGTERM)  # the first is preempted: it saves its step and asks to be requeued
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == REQUEUE_EXIT_CODE, out
    steps = _steps_logged(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # every line of the first run, once, in the directory
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{steps[-1]:08d}" and f"saved step {steps[-1]} on SIGTERM" in out
    assert not list(run_dir.glob("metrics.after-step*"))  # nothing of the first moved aside by the second

    # the first has ended: its directory is free again, and the requeued run continues it
    trainer = Trainer(load_config(None, [*BASE, f"--train.steps={steps[-1] + 2}", f"--train.run_dir={run_dir}",
                                         "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert trainer.start_step == steps[-1]
    trainer.run()
    assert _steps_logged(run_dir) == list(range(1, steps[-1] + 3))
