"""Gradient buckets (parallel.grad_bucket_blocks) on CPU: reduce-scatters per step, the time they
leave exposed (gloo blocks the backward, so all of it) and the step time, by bucket size.

`longctx train` on 4 ranks (expert 4 x (head 2 x ctx 2)) of debug-moe with --layers blocks, for
each bucket size in turn, the sizes taking turns --rounds times (other load on the machine then
hits them alike); per run the median over the steps after the first two of the metrics' per-step
figures. The same run's losses are compared (bucketing does not change them).

Prints one JSON document. Usage: python benchmarks/grad_buckets.py [--layers 8] [--buckets 1,2,4,0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

LAYOUT = ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"]


def run(buckets: int, layers: int, steps: int, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx", "train", "--nproc=4", "--model.preset=debug-moe",
               f"--model.layers={layers}", f"--train.seq_len={seq}", f"--train.steps={steps}",
               "--train.eval_interval=0", "--metrics.log_interval=1", "--metrics.plots=false",
               "--metrics.progress=false", f"--parallel.grad_bucket_blocks={buckets}", f"--train.run_dir={tmp}",
               *LAYOUT]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        plan = next(line for line in r.stdout.splitlines() if line.startswith("gradient buckets"))
        recs = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if x.get("kind") == "train"][2:]
    return {"plan": plan, "losses": [x["loss"] for x in recs if x.get("kind") == "train"],
            "calls": train[-1]["grad_reduce_calls"],
            "exposed_s": statistics.median(x["grad_reduce_exposed_s"] for x in train),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in train)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--buckets", default="1,2,4,0")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    sizes = [int(b) for b in a.buckets.split(",")]
    runs: dict[int, list[dict]] = {b: [] for b in sizes}
    for _ in range(a.rounds):
        for b in sizes:
            runs[b].append(run(b, a.layers, a.steps, a.seq))
            last = runs[b][-1]
            print(f"buckets {b}: {last['plan']}; exposed {last['exposed_s'] * 1e3:.1f} ms", file=sys.stderr)
    base = runs[sizes[0]][0]["losses"]
    rows = [{"grad_bucket_blocks": b, "plan": r[0]["plan"], "reduce_scatters_per_step": r[0]["calls"],
             "exposed_s": min(x["exposed_s"] for x in r), "tokens_per_s": max(x["tokens_per_s"] for x in r),
             "max_loss_diff_vs_first": max(abs(u - v) for x in r for u, v in zip(x["losses"], base))}
            for b, r in runs.items()]
    print(json.dumps({"bench": "grad_buckets", "date": date.today().isoformat(), "layers": a.layers,
                      "seq_len": a.seq, "steps": a.steps, "rounds": a.rounds, "layout": LAYOUT,
                      "timing": "per run the median over steps 3.. of the metrics; per size the best run",
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
