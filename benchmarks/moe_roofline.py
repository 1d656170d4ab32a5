"""A roofline audit of the MoE layer against the dense SwiGLU of the same active parameters (issue 52 item 2):
every aten op of one forward + backward of `longctx bench moe`'s two layers (bench/moe_common.py build_layers,
fwd_bwd; bf16 weights and inputs, as `--device cuda` runs them), with its H200 time estimated as
benchmarks/step_roofline.py estimates it (matmuls at the bf16 dense peak, every other op at the memory bandwidth
over the bytes it reads and writes; views free; launches counted). Runs on CPU.

    python benchmarks/moe_roofline.py --tokens 512,1024 --target 8192 --out X.json

Why: the H200 measured the MoE layer at 2.85x the dense one at 8K (7.96 vs 2.79 ms) with equal GEMM FLOPs.
The roofline tells how much of that the op stream itself costs (bytes of the permutations, sorts, fp32
intermediates, fills) and how much is left to the grouped GEMMs' efficiency and launches, which a CPU cannot see.

Each op's FLOPs and bytes are fitted as a + b x tokens from two token counts (the op streams are the same op
for op) and its time taken at `--target` (the layer is linear in tokens: its sorts are over tokens x k keys, and
on a GPU a radix sort's passes are linear too). It also gives the least bytes a dispatch must move (one gather
of tokens x k rows in, one weighted combine out, their backward) for comparison. The GEMMs are taken at the peak:
how far the grouped kernel falls below it (and below the dense GEMM) is a GPU's to measure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_roofline as sr  # noqa: E402
from longctx.bench import moe_common  # noqa: E402


def bench_args(dim: int, experts: int, top_k: int, expert_dim: int, seed: int = 0) -> SimpleNamespace:
    """What build_layers reads of `longctx bench moe`'s arguments."""
    return SimpleNamespace(dim=dim, experts=experts, top_k=top_k, expert_dim=expert_dim, seed=seed)


def layers_bf16(args: SimpleNamespace):
    """The bench's MoE and dense layers in bf16 (moe_gpu.py: `.to(device, torch.bfloat16)`; the router's gate
    and selection bias stay fp32, models/moe.py Router._apply)."""
    moe, dense, _ = moe_common.build_layers(args)
    return moe.to(torch.bfloat16), dense.to(torch.bfloat16)


class SiteRecorder(sr.Recorder):
    """step_roofline's Recorder that also notes where each op comes from: the autograd node running it in
    backward (IndexSelectBackward0, ...), else the innermost longctx source line."""

    def __post_init__(self):
        super().__post_init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.ops) > before:
            self.sites.append(_site())
        return out


def _site() -> str:
    node = torch._C._current_autograd_node()
    if node is not None:
        return "backward of " + node.name()
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/longctx/" in path and "/bench/" not in path:
            return f"{path.split('/longctx/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def record_layer(layer, tokens: int, dim: int, seed: int = 1) -> tuple[list[sr.Op], list[str]]:
    """The ops (and their sites) of one forward + backward of `layer` on [1, tokens, dim] bf16, after a warm-up."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, dim, generator=gen, dtype=torch.bfloat16).requires_grad_()
    grad = torch.randn(1, tokens, dim, generator=gen, dtype=torch.bfloat16)
    moe_common.fwd_bwd(layer, x, grad)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    rec = SiteRecorder(params)
    with rec:
        moe_common.fwd_bwd(layer, x, grad)
    return rec.ops, rec.sites


def _rate(kind: str) -> float:
    return sr.BF16_FLOPS if kind == "matmul bf16" else sr.FP32_FLOPS if kind == "matmul fp32" else 0.0


def at_target(small: list[sr.Op], large: list[sr.Op], s1: int, s2: int, target: int) -> list[sr.Op]:
    """Each op at `target` tokens: its FLOPs and bytes linear in tokens (from the two runs, whose op streams
    are the same op for op), then its roofline time there. (Fitting the times instead would carry a small
    run's weight-bound grouped GEMMs, max(FLOPs, bytes) there, into the FLOP-bound target.)"""
    if [(o.name, o.kind) for o in small] != [(o.name, o.kind) for o in large]:
        raise ValueError(f"the op streams at {s1} and {s2} tokens differ: extrapolate from other token counts")
    out = []
    for a, b in zip(small, large):
        flops, moved = (u + (v - u) * (target - s1) / (s2 - s1) for u, v in ((a.flops, b.flops), (a.bytes, b.bytes)))
        seconds = max(flops / _rate(a.kind) if flops else 0.0, moved / sr.BANDWIDTH)
        out.append(sr.Op(a.name, a.kind, a.in_dtypes, a.out_dtype, flops, moved, seconds))
    return out


def table(ops: list[sr.Op], sites: list[str]) -> dict:
    """{"kind | name | in dtypes | out dtype | site": {ms, gflop, gb, kernels}}, the costliest first."""
    rows: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "gflop": 0.0, "gb": 0.0, "kernels": 0})
    for op, site in zip(ops, sites):
        row = rows[" | ".join((op.kind, op.name, op.in_dtypes, op.out_dtype, site))]
        row["ms"] += op.seconds * 1e3
        row["gflop"] += op.flops / 1e9
        row["gb"] += op.bytes / 1e9
        row["kernels"] += 1
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms"]))


def summary(est: dict) -> dict:
    kinds: dict[str, float] = defaultdict(float)
    for key, v in est.items():
        kinds[key.split(" | ")[0]] += v["ms"]
    syncs = sum(v["kernels"] for k, v in est.items() if k.startswith("host read"))
    return {"estimated_ms": sum(v["ms"] for v in est.values()),
            "gemm_ms": sum(v["ms"] for k, v in est.items() if k.startswith("matmul")),
            "other_ms": sum(v["ms"] for k, v in est.items() if not k.startswith("matmul")),
            "other_gb": sum(v["gb"] for k, v in est.items() if not k.startswith("matmul")),
            "kernels": sum(v["kernels"] for v in est.values()) - syncs, "host_reads": syncs,
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def minimum_movement(tokens: int, dim: int, top_k: int, experts: int, bytes_per: int = 2) -> dict:
    """The least bytes a dropless dispatch moves besides the GEMMs' own operands, forward + backward, bf16 rows:
    forward: the gather of tokens x k rows (read the token rows, write the k copies) and the weighted combine
    (read tokens x k result rows, write tokens rows); backward: the combine's (read the output gradient, write
    tokens x k row gradients; the weights' gradient reads the saved results once more) and the gather's
    (read tokens x k gradient rows, write tokens rows). Routing's [tokens, experts] fp32 softmax and top-k and
    the sort of tokens x k keys are small beside these at dim 2048."""
    rows = tokens * dim * bytes_per
    fwd = (rows + top_k * rows) + (top_k * rows + rows)
    bwd = (rows + top_k * rows + top_k * rows) + (top_k * rows + rows)
    routing = tokens * experts * 4 * 4 + tokens * dim * (bytes_per + 4)  # logits, softmax and their backward
    total = fwd + bwd + routing
    return {"gb": total / 1e9, "ms": total / sr.BANDWIDTH * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-dim", type=int, default=768)
    ap.add_argument("--tokens", default="512,1024", help="two token counts to run at")
    ap.add_argument("--target", type=int, default=8192, help="tokens to estimate for")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    s1, s2 = (int(s) for s in a.tokens.split(","))
    moe, dense = layers_bf16(bench_args(a.dim, a.experts, a.top_k, a.expert_dim))
    result = {"config": vars(a), "peaks": {"bf16_flops": sr.BF16_FLOPS, "bytes_per_s": sr.BANDWIDTH}}
    for name, layer in (("moe", moe), ("dense", dense)):
        (small, _), (large, sites) = record_layer(layer, s1, a.dim), record_layer(layer, s2, a.dim)
        est = table(at_target(small, large, s1, s2, a.target), sites)
        result[name] = {**summary(est), "ops": est}
        print(json.dumps({name: summary(est)}, indent=1), flush=True)
    result["minimum_dispatch_movement"] = minimum_movement(a.target, a.dim, a.top_k, a.experts)
    print(json.dumps({"minimum_dispatch_movement": result["minimum_dispatch_movement"]}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
