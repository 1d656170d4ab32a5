"""Convergence of the slow-link modes against their synchronous baselines (issue 50): the default
debug model on 8 ranks, the same data and initialisation, train.steps steps each.

- global batch 8 (one sequence per rank), as the debug config otherwise;
- fsdp (8 ranks, one FSDP group) against qwz + qgz (2 nodes of 4: weights gathered and gradients
  reduce-scattered as int8 blocks);
- sync against co2 (2 replicas of 4 ranks, parallel.dp_replicate = 2; co2 with H local steps),
  at equal tokens (the same global batch each step).

Writes JSON (every loss, the final mean of the last 20 steps and the evaluation losses) and a PNG of
the curves. Takes minutes per mode on a 2-core CPU:

    python benchmarks/slow_link_convergence.py --out docs/results/slow_link_convergence.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

MODES = {
    "fsdp": [],
    "qwz_qgz": ["--parallel.zero_pp=qwz,qgz", "--parallel.ranks_per_node=4"],
    "sync": ["--parallel.dp_replicate=2"],
    "co2": ["--parallel.dp_replicate=2", "--train.data_parallel=co2"],
}


def _run(args: list[str], run_dir: str) -> dict:
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}", "--metrics.plots=false",
                                             "--metrics.progress=false"])
    started = time.perf_counter()
    result = train(cfg, log=lambda *a, **k: None)
    return {"losses": result.losses, "eval_losses": {str(k): v for k, v in result.eval_losses.items()},
            "seconds": time.perf_counter() - started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write (the PNG goes beside it)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--co2-local-steps", type=int, default=4)
    p.add_argument("--co2", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="another co2 variant, e.g. 'mom=--train.co2_outer_momentum=0.5' (repeatable)")
    p.add_argument("--only", default="", help="comma-separated modes to run (default: all)")
    p.add_argument("--every", default="", metavar="OVERRIDES",
                   help="overrides for every mode, e.g. --every=--train.grad_clip=0 (sync and co2 alike)")
    p.add_argument("--work", default="/tmp/slow_link_convergence")
    a = p.parse_args()
    common = [f"--train.steps={a.steps}", f"--train.co2_local_steps={a.co2_local_steps}", "--train.global_batch=8",
              *a.every.split()]
    modes = dict(MODES)
    for variant in a.co2:
        name, _, overrides = variant.partition("=")
        modes[f"co2_{name}"] = [*MODES["co2"], *overrides.split()]
    if a.only:
        modes = {m: v for m, v in modes.items() if m in a.only.split(",")}
    shutil.rmtree(a.work, ignore_errors=True)  # (a run directory that holds a run is refused)
    jobs = [(mode, _run, ([*common, *extra], f"{a.work}/{mode}")) for mode, extra in modes.items()]
    runs = {mode: r[0] for mode, r in run_spawned_many(8, jobs, timeout=6 * 3600).items()}
    for r in runs.values():
        r["final_loss"] = sum(r["losses"][-20:]) / len(r["losses"][-20:])
    pairs = {"qwz_qgz / fsdp": ("qwz_qgz", "fsdp"),
             **{f"{m} / sync": (m, "sync") for m in runs if m.startswith("co2")}}
    pairs = {k: v for k, v in pairs.items() if set(v) <= set(runs)}
    ratios = {name: runs[x]["final_loss"] / runs[y]["final_loss"] for name, (x, y) in pairs.items()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/slow_link_convergence.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()), "world": 8, "steps": a.steps,
        "final_loss_ratios": ratios, "runs": runs}, indent=1))
    _plot(runs, out.with_suffix(".png"))
    print(json.dumps({"final_loss_ratios": ratios, **{m: round(r["final_loss"], 4) for m, r in runs.items()}}))
    return 0


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    co2 = tuple(m for m in runs if m.startswith("co2"))
    for ax, modes in zip(axes, (("fsdp", "qwz_qgz"), ("sync", *co2))):
        for mode in (m for m in modes if m in runs):
            losses = runs[mode]["losses"]
            smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
            ax.plot(range(1, len(losses) + 1), smooth, label=mode)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
