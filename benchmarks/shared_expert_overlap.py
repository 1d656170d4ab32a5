"""What overlapping a MoE layer's shared experts with the expert-parallel return transfer saves (issue 52: "the
shared expert is overlapped with dispatch where the schedule allows"), on an emulated link (CPU; gloo ranks).

    python benchmarks/shared_expert_overlap.py --ranks 4 --tokens 2048 --out X.json

One MoE layer with a shared expert (Qwen2-MoE's shape, scaled: dim 512, 16 experts of 352, top 4, one shared
expert of 4 x 352 with its sigmoid gate), expert parallel over all ranks (one node: bench/emulated_link.py's
intra-node link at --gbps per rank), --tokens per rank. Forward + backward, --repeats times, with the shared
experts run while the routed results travel back (and their backward while the gradients travel out:
job/split_transfer.py) and with them run after the combine (the one-device order, and the layer's under
pipelined chunks), alternating; seconds per pass (the median over ranks of each rank's least) and the seconds
blocked on the emulated links (`exposed_s`). The two orders compute the same values (tests/distributed/
test_shared_expert_overlap.py). On a CPU the ranks share the cores, so only the link time can hide; on GPUs the
transfer and the shared expert's GEMMs run on separate engines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _layer(dim: int):
    from longctx.config import ModelConfig
    from longctx.models.moe import MoEFeedForward

    cfg = ModelConfig(dim=dim, ffn_dim=4 * dim, moe_experts=16, moe_top_k=4, moe_expert_dim=352,
                      moe_shared_experts=1, moe_shared_dim=4 * 352, moe_shared_gate=True)
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02)
    return layer


def _rank(tokens: int, dim: int, gbps: float, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from longctx.bench.emulated_link import LinkProfile, emulate, exposed_seconds
    from longctx.parallel.expert.install import use_expert_parallel

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("expert_data", "expert"))
    layer = _layer(dim)
    dispatcher = use_expert_parallel(nn.Sequential(layer), mesh)
    modes = {"overlapped": lambda: True, "after": lambda: False}  # (after: the shared experts after the combine)
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))

    def one() -> None:
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()

    one()  # (warm)
    out = {"overlapped": {"s": [], "exposed_s": []}, "after": {"s": [], "exposed_s": []}}
    profile = LinkProfile(ranks_per_node=world, intra_bytes_per_s=gbps * 1e9, inter_bytes_per_s=gbps * 1e9)
    for _ in range(repeats):
        for name, overlaps in modes.items():
            dispatcher.overlaps_beside = overlaps
            with emulate(profile):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                one()
                out[name]["s"].append(time.perf_counter() - t0)
                out[name]["exposed_s"].append(exposed_seconds())
    return {name: {"s": min(v["s"]), "exposed_s": min(v["exposed_s"])} for name, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--gbps", type=float, default=0.5, help="the emulated link's GB/s per rank, one direction")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from longctx.job.spawn import run_spawned_many

    ranks = run_spawned_many(args.ranks, [("run", _rank, (args.tokens, args.dim, args.gbps, args.repeats))])["run"]
    result = {"benchmark": "shared_expert_overlap", "ranks": args.ranks, "tokens_per_rank": args.tokens,
              "dim": args.dim, "gbps": args.gbps, "repeats": args.repeats, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    for name in ("overlapped", "after"):
        result[name] = {k: statistics.median(r[name][k] for r in ranks) for k in ("s", "exposed_s")}
    result["ratio"] = result["overlapped"]["s"] / result["after"]["s"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
