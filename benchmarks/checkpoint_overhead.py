"""Checkpoint overhead: step time with a save every step (async, and sync) against no saves.

Same-run comparison on this machine; prints one JSON document. The blocking part of an async save
(staging into host memory, plus any wait for the previous save) is read from the metrics
(`checkpoint_blocking_s`), the full save time (write, checksums, commit) from the synchronous runs.
Usage: python benchmarks/checkpoint_overhead.py [--nproc 1] [--steps 12]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(nproc, steps, extra):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx", "train", f"--nproc={nproc}", f"--train.steps={steps}",
               "--train.eval_interval=0", "--metrics.log_interval=1", "--metrics.plots=false",
               "--metrics.progress=false", "--data.max_docs=300", f"--train.run_dir={tmp}", *extra]
        if nproc > 1:
            cmd.append("--parallel.ctx=2")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        recs = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = [x for x in recs if x["kind"] == "train" and x["step"] > 2]
    tps = sum(x["tokens_per_s"] for x in timed) / len(timed)
    blocking = sorted(x.get("checkpoint_blocking_s", 0.0) for x in timed)
    # the median as well as the mean: on a shared 2-core machine a few saves that wait for a slow
    # previous one (or for another process) move the mean a lot
    return {"tokens_per_s": tps, "blocking_s_per_step": sum(blocking) / len(blocking),
            "blocking_s_median": blocking[len(blocking) // 2]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    none = run(a.nproc, a.steps, [])
    asyn = run(a.nproc, a.steps, ["--checkpoint.interval=1", "--checkpoint.async=true"])
    sync = run(a.nproc, a.steps, ["--checkpoint.interval=1", "--checkpoint.async=false"])
    print(json.dumps({
        "bench": "checkpoint_overhead", "nproc": a.nproc, "no_saves": none, "async_every_step": asyn,
        "sync_every_step": sync,
        "step_time_ratio_async_vs_none": none["tokens_per_s"] / asyn["tokens_per_s"],
        "step_time_ratio_sync_vs_none": none["tokens_per_s"] / sync["tokens_per_s"],
        "async_blocking_s": asyn["blocking_s_per_step"], "sync_save_s": sync["blocking_s_per_step"],
        "async_blocking_s_median": asyn["blocking_s_median"], "sync_save_s_median": sync["blocking_s_median"],
    }, indent=2))


if __name__ == "__main__":
    main()
