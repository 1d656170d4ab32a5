"""The context-extension recipe end to end on CPU, timed: pretrain short with the passkey mixture,
extend (YaRN x4 + progressive 2K -> 4K), and evaluate both models at 1K and 4K.

    python benchmarks/extension_recipe.py [--out docs] [--samples 10]

Runs exactly the README's commands (configs/passkey-pretrain.toml, configs/extend.toml, longctx
eval) in a fresh directory and writes extension_recipe_<date>.json (accuracy per length and depth,
seconds per phase) and the heatmaps extension_{pretrained,extended}_<date>.png next to it.
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


def longctx(*args: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "longctx", *args], cwd=cwd, text=True, capture_output=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode:
        sys.exit(f"longctx {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--samples", type=int, default=10, help="passkey prompts per length and depth")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    args = ap.parse_args()
    out, stamp = Path(args.out), date.today().isoformat()
    work = Path(tempfile.mkdtemp(prefix="longctx-extend-"))
    (work / "configs").symlink_to(ROOT / "configs")
    seconds = {}
    seconds["pretrain"] = longctx("train", "--config", "configs/passkey-pretrain.toml", "--nproc", "1",
                                  "--train.run_dir", "runs/pretrain", "--metrics.progress", "false", cwd=work)
    evals = {}

    def evaluate(name: str, checkpoint: str) -> None:
        target = work / f"{name}.json"
        seconds[f"eval {name}"] = longctx("eval", "--checkpoint", checkpoint, "--task", "passkey", "--lengths",
                                          "1K,4K", "--depths", args.depths, "--samples", str(args.samples),
                                          "--output", str(target), cwd=work)
        evals[name] = json.loads(target.read_text())
        out.mkdir(parents=True, exist_ok=True)
        (out / f"extension_{name}_{stamp}.png").write_bytes(target.with_suffix(".png").read_bytes())

    evaluate("pretrained", "runs/pretrain/checkpoints")
    seconds["extend"] = longctx("train", "--config", "configs/extend.toml", "--nproc", "1", "--train.run_dir",
                                "runs/extend", "--metrics.progress", "false", cwd=work)
    evaluate("extended", "runs/extend/checkpoints")
    table = {name: {str(length): sum(r["correct"] for r in e["results"] if r["length"] == length) /
                    sum(r["samples"] for r in e["results"] if r["length"] == length)
                    for length in sorted({r["length"] for r in e["results"]})}
             for name, e in evals.items()}
    result = {
        "command": "python benchmarks/extension_recipe.py", "date": stamp,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "seconds": {k: round(v, 1) for k, v in seconds.items()}, "total_seconds": round(sum(seconds.values()), 1),
        "accuracy_by_length": table,
        "results": {name: [{k: r[k] for k in ("length", "depth", "samples", "correct", "accuracy", "answer_nll")}
                           for r in e["results"]] for name, e in evals.items()},
        "rope": {name: e["rope"] for name, e in evals.items()},
    }
    path = out / f"extension_recipe_{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"accuracy_by_length": table, "seconds": result["seconds"],
                      "total_seconds": result["total_seconds"]}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
