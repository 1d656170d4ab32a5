"""The context-extension recipe end to end on CPU, timed: pretrain short with the passkey mixture,
extend (YaRN x4 + progressive 2K -> 4K), and evaluate both models at 1K and 4K, each two ways.

    python benchmarks/extension_recipe.py [--out docs/results] [--samples 10] [--work DIR]

Runs exactly the README's commands (configs/passkey-pretrain.toml, configs/extend.toml, longctx
eval) in a fresh directory (or --work DIR: a training phase whose timing is recorded there from an
earlier run is not run again, so a failed evaluation can be redone without retraining), and writes
extension_recipe_<date>.json and the heatmaps extension_{pretrained,extended}[_generate]_<date>.png.

Each checkpoint is evaluated with `--mode score` (one teacher-forced forward pass: every answer
token is the argmax) and `--mode generate` (free greedy generation, exact match of the first run of
digits); the extended one also with `--mode generate --nproc 4` (head 2 x ctx 2, the cache sharded).
The JSON has accuracy per length for each, the per-sample agreement of the two modes, and whether
the sharded generation gave the same verdicts and texts as one process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_work import ROOT, RecipeWork  # noqa: E402

SHARDED = "generate head2xctx2"


def by_length(e: dict) -> dict:
    return {str(length): sum(r["correct"] for r in e["results"] if r["length"] == length) /
            sum(r["samples"] for r in e["results"] if r["length"] == length)
            for length in sorted({r["length"] for r in e["results"]})}


def verdicts(e: dict) -> list[bool]:
    return [v for r in e["results"] for v in r["per_sample"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--samples", type=int, default=10, help="passkey prompts per length and depth")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--work", default="", help="the working directory (default: a fresh temporary one); the "
                                               "training phases already timed there are reused")
    args = ap.parse_args()
    out, stamp = Path(args.out), date.today().isoformat()
    work = RecipeWork(args.work, "longctx-extend-")
    seconds, train = work.seconds, work.train

    evals: dict[str, dict[str, dict]] = {}

    def evaluate(name: str, checkpoint: str, mode: str, nproc: int = 1) -> None:
        label = mode if nproc == 1 else SHARDED
        suffix = "" if mode == "score" else f"_{mode}" if nproc == 1 else f"_{mode}_nproc{nproc}"
        target = work.dir / f"{name}{suffix}.json"
        work.run(f"eval {name} {label}",
                 "eval", "--checkpoint", checkpoint, "--task", "passkey", "--lengths", "1K,4K", "--depths", args.depths,
                 "--samples", str(args.samples), "--mode", mode, "--nproc", str(nproc), "--output", str(target))
        evals.setdefault(name, {})[label] = json.loads(target.read_text())
        out.mkdir(parents=True, exist_ok=True)
        (out / f"extension_{name}{suffix}_{stamp}.png").write_bytes(target.with_suffix(".png").read_bytes())

    train("pretrain", "configs/passkey-pretrain.toml")
    evaluate("pretrained", "runs/pretrain/checkpoints", "score")
    evaluate("pretrained", "runs/pretrain/checkpoints", "generate")
    train("extend", "configs/extend.toml")
    evaluate("extended", "runs/extend/checkpoints", "score")
    evaluate("extended", "runs/extend/checkpoints", "generate")
    evaluate("extended", "runs/extend/checkpoints", "generate", nproc=4)

    table = {name: {label: by_length(e) for label, e in modes.items()} for name, modes in evals.items()}
    agreement = {}
    for name, modes in evals.items():
        s, g = verdicts(modes["score"]), verdicts(modes["generate"])
        agreement[name] = {"samples": len(s), "same_verdict": sum(a == b for a, b in zip(s, g)),
                           "score_only": sum(a and not b for a, b in zip(s, g)),
                           "generate_only": sum(b and not a for a, b in zip(s, g)),
                           "max_points_apart": round(100 * max(abs(table[name]["score"][k] - table[name]["generate"][k])
                                                               for k in table[name]["score"]), 1)}
    one, four = evals["extended"]["generate"], evals["extended"][SHARDED]
    sharded = {"layout": four["layout"],
               "same_verdicts": verdicts(one) == verdicts(four),
               "same_texts": [r["generated"] for r in one["results"]] == [r["generated"] for r in four["results"]]}
    result = {
        "command": "python benchmarks/extension_recipe.py", "date": stamp,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "seconds": {k: round(v, 1) for k, v in seconds.items()}, "total_seconds": round(sum(seconds.values()), 1),
        "accuracy_by_length": table,
        "score_vs_generate": agreement,
        "generate_head2xctx2_vs_one_process": sharded,
        "results": {f"{name} {label}": [{k: r[k] for k in ("length", "depth", "samples", "correct", "accuracy")
                                         if k in r} | ({"answer_nll": r["answer_nll"]} if "answer_nll" in r else {})
                                        | ({"generated": r["generated"]} if "generated" in r else {})
                                        for r in e["results"]]
                    for name, modes in evals.items() for label, e in modes.items()},
        "rope": {name: modes["score"]["rope"] for name, modes in evals.items()},
    }
    path = out / f"extension_recipe_{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"accuracy_by_length": table, "score_vs_generate": agreement,
                      "generate_head2xctx2_vs_one_process": sharded, "seconds": result["seconds"],
                      "total_seconds": result["total_seconds"]}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
