"""MoE training signal and balancing on CPU, reproducibly: the runs behind docs/moe.md's figures.

    python benchmarks/moe_figures.py [--out docs/results] [--runs DIR] [--steps 100] [--balance-steps 200]
                                     [--rates 0.001,0.01]

Five `longctx train --nproc 1` runs on the default data (Python standard library, byte tokenizer,
seed 0: every run sees the same batches), checkpoints off, a metrics line every 5 steps:
- dense: --model.preset debug;   moe: --model.preset debug-moe (softmax top-2 of 8, aux 0.01, z 0.001);
- dts: debug-moe with --model.moe.router dts --model.moe.dts_steps 50 (same steps as moe);
- free: debug-moe with --model.moe.aux_loss 0 (no balancing; z-loss 0.001 kept), --balance-steps;
- bias<RATE>: free plus --model.moe.bias_update_rate RATE (aux-loss-free balancing), --balance-steps,
  for each of --rates.
Writes moe_loss_<date>.png (training loss of dense, moe, dts; load of moe and dts),
moe_balance_<date>.png (max/mean expert load of free and the bias runs) and moe_figures_<date>.json
(per run: the command, final and last-5-lines mean training loss, eval losses, load over the run).
Runs whose metrics.jsonl is complete in --runs are reused (so an interrupted call continues).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--nproc", "1", "--checkpoint.interval", "0", "--metrics.log_interval", "5", "--metrics.progress", "false",
          "--metrics.plots", "false", "--train.eval_interval", "50"]


def runs(steps: int, balance_steps: int, rates: list[str]) -> dict[str, list[str]]:
    moe = ["--model.preset", "debug-moe"]
    free = [*moe, "--model.moe.aux_loss", "0"]
    plan = {
        "dense": ["--model.preset", "debug", "--train.steps", str(steps)],
        "moe": [*moe, "--train.steps", str(steps)],
        "dts": [*moe, "--model.moe.router", "dts", "--model.moe.dts_steps", "50", "--train.steps", str(steps)],
        "free": [*free, "--train.steps", str(balance_steps)],
    }
    for rate in rates:
        plan[f"bias{rate}"] = [*free, "--model.moe.bias_update_rate", rate, "--train.steps", str(balance_steps)]
    return plan


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(name: str, args: list[str], run_dir: Path, steps: int) -> tuple[list[dict], float | None]:
    metrics, wall = run_dir / "metrics.jsonl", run_dir / "wall_s.txt"
    if metrics.exists() and any(r["kind"] == "train" and r["step"] == steps for r in read(metrics)):
        print(f"{name}: reusing {run_dir}", file=sys.stderr, flush=True)
        return read(metrics), float(wall.read_text()) if wall.exists() else None
    cmd = [sys.executable, "-m", "longctx", "train", *COMMON, *args, "--train.run_dir", str(run_dir)]
    print(f"{name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode:
        sys.exit(f"{name} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    wall.write_text(f"{seconds:.1f}\n")
    return read(metrics), seconds


def summary(records: list[dict], args: list[str], seconds: float | None) -> dict:
    train = [r for r in records if r["kind"] == "train"]
    out = {"command": "longctx train " + " ".join([*COMMON, *args]), "wall_s": seconds,
           "steps": train[-1]["step"], "final_loss": train[-1]["loss"],
           "mean_loss_last_5_lines": sum(r["loss"] for r in train[-5:]) / len(train[-5:]),
           "eval_loss": {r["step"]: r["loss"] for r in records if r["kind"] == "eval"}}
    if "moe_load_mean" in train[-1]:
        half = [r for r in train if r["step"] > train[-1]["step"] / 2]
        for key in ("moe_load_mean", "moe_load_worst"):
            vals = [r[key] for r in train]
            out[key] = {"mean_over_run": sum(vals) / len(vals), "max_over_run": max(vals), "final": vals[-1],
                        "mean_second_half": sum(r[key] for r in half) / len(half)}
        out["moe_aux_loss_final"] = train[-1]["moe_aux_loss"]
        out["moe_z_loss_final"] = train[-1]["moe_z_loss"]
    return out


def plot(results: dict[str, list[dict]], out: Path, stamp: str, rates: list[str]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(name, key):
        rows = [r for r in results[name] if r["kind"] == "train"]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def loss_top(names):  # the first steps' losses (5.7 at step 1) would flatten the rest
        later = [r["loss"] for n in names for r in results[n] if r["kind"] == "train" and r["step"] >= 10]
        return max(later) * 1.02 if later else None

    paths = []
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"dense": "dense (debug)", "moe": "MoE softmax top-2 (debug-moe)", "dts": "MoE DTS-Gate, dts_steps 50"}
    colors = {"dense": "C0", "moe": "C1", "dts": "C2", "free": "C3"}
    colors.update({f"bias{rate}": f"C{4 + i}" for i, rate in enumerate(rates)})
    for name, label in labels.items():
        a.plot(*series(name, "loss"), label=label, color=colors[name])
        evals = [r for r in results[name] if r["kind"] == "eval"]
        a.scatter([r["step"] for r in evals], [r["loss"] for r in evals], marker="x", color=colors[name])
    a.set(xlabel="step", ylabel="training loss (x: eval loss)", title="same data, same steps",
          ylim=(None, loss_top(labels)))
    a.legend()
    for name in ("moe", "dts"):
        b.plot(*series(name, "moe_load_mean"), label=f"{labels[name]}: mean over layers", color=colors[name])
        b.plot(*series(name, "moe_load_worst"), linestyle="--", label=f"{labels[name]}: worst layer",
               color=colors[name])
    b.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load (1 = even, 4 = one expert "
                                                                         "takes half)")
    b.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / f"moe_loss_{stamp}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"free": "no balancing"}
    labels.update({f"bias{rate}": f"bias_update_rate {rate}" for rate in rates})
    for name, label in labels.items():
        a.plot(*series(name, "moe_load_mean"), label=f"{label}: mean", color=colors[name])
        a.plot(*series(name, "moe_load_worst"), linestyle="--", label=f"{label}: worst layer", color=colors[name])
        b.plot(*series(name, "loss"), label=label, color=colors[name])
    a.set(xlabel="step", ylabel="max / mean tokens per expert",
          title="aux_loss 0: expert load", ylim=(0.9, 5.3))
    a.legend(fontsize=7, loc="upper right", ncol=2)
    b.set(xlabel="step", ylabel="training loss", title="aux_loss 0: training loss", ylim=(None, loss_top(labels)))
    b.legend()
    fig.tight_layout()
    paths.append(out / f"moe_balance_{stamp}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--runs", default="", help="run directories go here (default: a new temporary directory)")
    ap.add_argument("--steps", type=int, default=100, help="steps of dense, moe and dts")
    ap.add_argument("--balance-steps", type=int, default=200, help="steps of free and bias")
    ap.add_argument("--rates", default="0.001,0.01", help="comma-separated model.moe.bias_update_rate of the bias runs")
    ap.add_argument("--only", default="", help="comma-separated subset of dense,moe,dts,free,bias<RATE> (no figures)")
    args = ap.parse_args()
    out, stamp = Path(args.out), date.today().isoformat()
    work = Path(args.runs or tempfile.mkdtemp(prefix="longctx-moe-figures-"))
    rates = [r for r in args.rates.split(",") if r]
    plan = runs(args.steps, args.balance_steps, rates)
    names = [n for n in args.only.split(",") if n] or list(plan)
    results, summaries = {}, {}
    for name in names:
        steps = args.steps if name in ("dense", "moe", "dts") else args.balance_steps
        results[name], seconds = train(name, plan[name], work / name, steps)
        summaries[name] = summary(results[name], plan[name], seconds)
        print(f"{name}: final loss {summaries[name]['final_loss']:.4f}", file=sys.stderr, flush=True)
    if args.only:
        print(json.dumps(summaries, indent=2))
        return
    out.mkdir(parents=True, exist_ok=True)
    paths = plot(results, out, stamp, rates)
    doc = {"date": stamp, "runs_dir": str(work), "runs": summaries, "figures": [p.name for p in paths],
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    import torch

    doc["machine"]["torch"] = torch.__version__
    target = out / f"moe_figures_{stamp}.json"
    target.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {target} and {', '.join(str(p) for p in paths)}", file=sys.stderr)


if __name__ == "__main__":
    main()
