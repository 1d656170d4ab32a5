"""Plans for the MoE presets at long context, with and without expert parallelism (issue: expert
parallelism, planner item): for Qwen3-30B-A3B and Mixtral-8x7B at 128K and 1M tokens on 8 and 64
H100-80GB, the planner's best plan, its best plan at expert 8, and the layout of Megatron's "MoE
parallel folding" example (context parallel 8 x expert parallel 8 over the same 8 GPUs of a node,
data parallel across nodes) under the best memory policy for it. JSON to stdout; a markdown table
with --markdown.

    python benchmarks/moe_plans.py [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.planner.search import Request, plan


def _row(e) -> dict | None:
    if e is None:
        return None
    return {"layout": e.mesh_shape.describe(), "policy": e.policy.describe(), "micro_batch": e.micro_batch,
            "step_s": round(e.step_s, 2), "tokens_per_s": round(e.tokens_per_s), "mfu": round(e.mfu, 3),
            "memory_gib": round(e.memory["total"] / 2**30, 1), "states_gib": round(e.memory["model_states"] / 2**30, 1),
            "expert_all_to_all_s": round(e.times.get("exposed_expert", 0.0), 2), "bottleneck": e.bottleneck}


def one(preset: str, gpus: int, seq: int, skew: float) -> dict:
    m = load_config(None, [f"--model.preset={preset}"]).model
    t0 = time.perf_counter()
    res = plan(Request(m, PRESETS["h100"], gpus, seq, expert_skew=skew))
    feasible = res.feasible
    best = feasible[0] if feasible else None
    best_ep8 = next((e for e in feasible if e.mesh_shape.expert == 8), None)
    folded = next((e for e in feasible if e.mesh_shape.expert == 8 and e.mesh_shape.ctx == 8
                   and e.mesh_shape.head == 1), None)
    return {"model": preset, "gpus": gpus, "seq_len": seq, "expert_skew": skew, "feasible": len(feasible),
            "best": _row(best), "best_expert8": _row(best_ep8), "ctx8_expert8": _row(folded),
            "suggestions": res.suggestions, "search_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--skew", type=float, default=2.0)
    args = ap.parse_args()
    rows = []
    for preset in ("qwen3-30b-a3b", "mixtral-8x7b"):
        for gpus in (8, 64):
            for seq in (131072, 1048576):
                rows.append(one(preset, gpus, seq, args.skew))
                print(f"{preset} {gpus} GPUs {seq}: done in {rows[-1]['search_s']} s", file=sys.stderr)
    if not args.markdown:
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | GPUs | tokens | best plan (step s, MFU, GiB) | best at expert 8 | ctx 8 x expert 8 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        def cell(x):
            if x is None:
                return "none fits"
            return (f"{x['layout']}, {x['policy']}, mb {x['micro_batch']}: {x['step_s']} s, "
                    f"{100 * x['mfu']:.1f}%, {x['memory_gib']} GiB (a2a {x['expert_all_to_all_s']} s)")
        best = cell(r["best"]) if r["best"] else "none fits: " + "; ".join(r["suggestions"][-2:])
        print(f"| {r['model']} | {r['gpus']} | {r['seq_len'] // 1024}K | {best} | {cell(r['best_expert8'])} "
              f"| {cell(r['ctx8_expert8'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
