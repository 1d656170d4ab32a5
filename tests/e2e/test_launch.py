"""`longctx train --nproc N`: layout errors before launch, and a killed rank ending the job."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_newcomer import longctx_here

ROOT = Path(__file__).resolve().parents[2]


def longctx(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_impossible_layouts_fail_before_launch():
    for args, needle in [
        (["--nproc", "4", "--parallel.head", "3"], "model.heads (4) must be divisible by parallel.head (3)"),
        (["--parallel.ctx", "3", "--nproc", "4"], "not divisible by the product of the given degrees"),
        (["--nproc", "4", "--parallel.ctx", "4", "--train.seq_len", "100"], "not divisible by 2 x ctx x head"),
        (["--nproc", "2", "--parallel.dp_shard", "2", "--train.global_batch", "3"], "split evenly into"),
    ]:
        t0 = time.time()
        r = longctx_here("train", *args)  # (refused before launch: in this process, any rank started still seen)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert needle in " ".join(r.stderr.split()), r.stderr
        assert time.time() - t0 < 30


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_killed_rank_ends_the_job_naming_it(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "longctx", "train", "--nproc", "2", "--parallel.ctx", "2", "--train.steps", "100000",
         "--train.seq_len", "128", "--data.max_docs", "100", "--train.eval_interval", "0",
         "--metrics.progress=false", "--parallel.timeout_s", "60", f"--train.run_dir={tmp_path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "metrics.jsonl").is_file():
            time.sleep(0.5)
        assert (tmp_path / "metrics.jsonl").is_file(), "training did not start"
        workers = [p for p in _children(proc.pid)
                   if "longctx" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) == 2, workers
        killed_at = time.time()
        os.kill(workers[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0
        assert time.time() - killed_at < 90
        text = " ".join(err.split())
        assert "rank 1 of 2 failed first (killed by SIGKILL)" in text, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
