"""Published long-context training results, reproduced as feasibility by the planner.

Each anchor is a request the literature reports as trained; the planner must find it feasible
with the techniques the paper used. Where the paper's point is that a technique is needed (MEMO:
offload), the plan without it must be infeasible or predicted slower: with chunked blocks, full
recomputation can fit where the paper's baselines ran out of memory, and MEMO's claim is then its
efficiency (no full recomputation), which is what the planner can check. The predicted MFU is
printed beside the published figure (the planner's efficiencies are generic, so the comparison is
a sanity check, not a fit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import strict_json
from ..config import load_config
from ..costs.hardware import get_hardware
from .search import Request, plan


@dataclass(frozen=True)
class Anchor:
    name: str
    source: str
    preset: str
    gpus: int
    gpus_per_node: int
    seq_len: int
    hardware: str  # a hardware preset
    published_mfu: float
    needs: str  # "" or the technique without which it must be infeasible: "offload"


ANCHORS = [
    Anchor("MEMO", "MEMO: 7B at 1M tokens on 8 x A800-80GB, 52.3% MFU (Llama3-8B shape here)",
           "llama3-8b", 8, 8, 2**20, "a800", 0.523, "offload"),
    Anchor("FPDT", "FPDT (Ulysses-Offload): 8B at 2M tokens on 4 x 80 GB, > 55% MFU",
           "llama3-8b", 4, 4, 2 * 2**20, "a100-80g", 0.55, "offload"),
    Anchor("USP", "USP: Llama3-8B at 208K tokens on 2 x 8 A800, 47% MFU",
           "llama3-8b", 16, 8, 208 * 1024, "a800", 0.47, ""),
]


def check(anchor: Anchor, hardware=None) -> dict:
    model = load_config(None, {"model": {"preset": anchor.preset}}).model
    hw = hardware or get_hardware(anchor.hardware)
    req = Request(model, hw, anchor.gpus, anchor.seq_len, gpus_per_node=anchor.gpus_per_node, global_batch=1)
    full = plan(req, keep_infeasible=False, explain=False)
    row = {"anchor": anchor.name, "source": anchor.source, "gpus": anchor.gpus, "seq_len": anchor.seq_len,
           "hardware": hw.name, "feasible": full.best is not None, "published_mfu": anchor.published_mfu,
           "evaluated": full.evaluated}
    if full.best is not None:
        b = full.best.as_dict()
        row.update(predicted_mfu=full.best.mfu, best=b["describe"], memory_gib=b["memory_gib"],
                   host_per_node_gib=b["host_per_node_gib"], bottleneck=full.best.bottleneck)
    if anchor.needs == "offload":
        # without offload: neither the blocks' (MEMO) nor the attention core's (FPDT) nor the model
        # states' (memory.model_states host tiers: host memory standing in for GPU memory too)
        no_offload = dataclasses.replace(req, offload_fractions=(), attention_offloads=(False,),
                                         model_states=("device",))
        without = plan(no_offload, keep_infeasible=False, explain=False).best
        row["feasible_without_offload"] = without is not None
        if without is not None:
            row["without_offload"] = {"best": without.as_dict()["describe"], "predicted_mfu": without.mfu}
        unchunked = plan(dataclasses.replace(no_offload, block_chunks=(0,)), keep_infeasible=False,
                         explain=False).best
        row["feasible_without_offload_or_block_chunks"] = unchunked is not None
        row["offload_needed"] = full.best is not None and (without is None or without.mfu < full.best.mfu)
    return row


def passed(row: dict) -> bool:
    return row["feasible"] and row.get("offload_needed", True)


def main(args=None) -> int:
    rows = [check(a) for a in ANCHORS]
    print(strict_json.dumps({"bench": "planner_anchors", "rows": rows}, indent=2))
    ok = all(passed(r) for r in rows)
    return 0 if ok else 1
