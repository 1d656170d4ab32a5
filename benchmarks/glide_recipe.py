"""The speculative-decoding recipe end to end on CPU, timed: train an 8-layer target (512 then 2048
tokens), a 1-layer GliDe draft against it and a plain 1-layer draft of the same width, then `longctx
bench decode`: GliDe as a chain and with CaPE, the plain draft as a chain, at 1K- and 8K-token
prompts (temperature 0, batch 1). The prompts are held out from training: Python sources the corpus
(the standard library) does not hold, those of the installed torch package by default (--data), one
per file, the 1K prompt the last 1K tokens of the 8K one (both continue the same text).

    python benchmarks/glide_recipe.py [--out docs/results] [--work DIR] [--lengths 1024,8192] [--samples 4]

Runs the README's commands (configs/glide-target.toml, configs/glide.toml, configs/glide-plain-draft.toml)
in a fresh directory (or --work DIR: a training phase whose timing is recorded there is not run again),
and writes glide_recipe_<date>.json: per draft and mode, tau, tau_without_bonus, acceptance_rate,
tokens_per_s, baseline_tokens_per_s, speedup and identical, overall and per prompt length.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_work import ROOT, RecipeWork  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--work", default="", help="the working directory (default: a fresh temporary one); the "
                                               "training phases already timed there are reused")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--samples", type=int, default=4, help="prompts per length (one per file)")
    ap.add_argument("--data", default="", help="bench decode --data (default: the installed torch package's "
                                               "Python sources, held out from the standard-library corpus)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--draft-window", type=int, default=512, help="bench decode --draft-window (GliDe: the draft's "
                                                                    "own pass over this many last prompt tokens)")
    ap.add_argument("--confidence-stop", type=float, default=0.0, help="bench decode --confidence-stop")
    ap.add_argument("--repeats", type=int, default=1, help="bench decode --repeats (the best of each)")
    args = ap.parse_args()
    out, stamp = Path(args.out), date.today().isoformat()
    data = args.data or str(Path(importlib.util.find_spec("torch").origin).parent / "**" / "*.py")
    work = RecipeWork(args.work, "longctx-glide-")
    seconds, train = work.seconds, work.train

    train("target", "configs/glide-target.toml")
    train("glide", "configs/glide.toml", "--draft.target", "runs/target/checkpoints",
          "--draft.block", str(args.speculate))
    train("plain-draft", "configs/glide-plain-draft.toml")

    common = ["--target", "runs/target/checkpoints", "--data", data, "--lengths", args.lengths, "--samples",
              str(args.samples), "--max-new-tokens", str(args.max_new_tokens), "--speculate", str(args.speculate),
              "--confidence-stop", str(args.confidence_stop), "--repeats", str(args.repeats)]
    # GliDe as a chain and with CaPE in one process, against the same plain runs (`--cape both`: separate
    # processes differ by more than the two do); the plain draft, GliDe's baseline, as a chain
    print("bench decode: glide (chain and CaPE)", file=sys.stderr)
    glide = json.loads(work.run("bench glide", "bench", "decode", *common, "--draft", "runs/glide/checkpoints",
                                "--draft-window", str(args.draft_window), "--cape", "both"))
    print("bench decode: plain-draft", file=sys.stderr)
    benches = {"glide": glide, "glide + cape": glide["with_cape"],
               "plain-draft": json.loads(work.run("bench plain-draft", "bench", "decode", *common, "--draft",
                                                  "runs/plain-draft/checkpoints", "--cape", "false"))}
    glide.pop("with_cape")
    keys = ("tau", "tau_without_bonus", "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s", "speedup",
            "identical")
    table = {name: {"all": {k: b[k] for k in keys},
                    **{str(g["prompt_tokens"]): {k: g[k] for k in keys} for g in b["by_length"]}}
             for name, b in benches.items()}
    result = {"command": "python benchmarks/glide_recipe.py", "date": stamp, "data": data,
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
              "speculate": args.speculate, "max_new_tokens": args.max_new_tokens, "samples": args.samples,
              "repeats": args.repeats,
              "seconds": {k: round(v, 1) for k, v in seconds.items()}, "total_seconds": round(sum(seconds.values()), 1),
              "figures": table, "bench": benches}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"glide_recipe_{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"figures": table, "seconds": result["seconds"], "total_seconds": result["total_seconds"]},
                     indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
