"""`longctx bench moe --cluster NODESxRANKS`: expert-parallel MoE layers on an emulated cluster.

What FSMoE's schedule buys is hidden communication, and on one small machine there is no network
to hide: every rank is a local process. So the ranks run the real expert-parallel code (gloo, the
same all-to-alls, parallel/expert/install.py and expert_pipeline.py) while bench/emulated_link.py makes
each of their collectives take the time a cluster's links would:

- NODES x RANKS processes; ranks are placed RANKS to a node; the MoE layers' experts split over all
  of them (parallel.expert = NODES x RANKS), as a wide expert-parallel group spans nodes;
- the links come from a planner hardware (--hardware, default h100: NVLink inside a node, its NIC
  between nodes; --inter-ratio overrides inter / intra) and are slowed by the factor this
  machine's measured GEMM rate per rank (all ranks computing at once) is slower than the
  hardware's effective rate, latency included, so communication keeps the share of the step it
  has on that cluster (--slowdown; --link-scale moves it on purpose);
- the work is the forward + backward of the named model's MoE layers (--layers of them, each
  `h = h + moe(h)` on random hidden states: attention does not take part in the exchange) on
  --tokens tokens per rank.

Each schedule (sequential: one all-to-all after the other; scheduled: --chunks pipelined chunks)
is timed --repeats times after a warm-up; a repeat's step time is the slowest rank's, its exposed
communication the time that rank spent blocked on a link; the least step time is reported, with
its exposed time. Cross-node bytes are what the ranks sent over inter-node links, per step.

Output: one JSON document on stdout; progress on stderr. Training never emulates a link; on a real
cluster, --no-emulation runs the same measurement on its real network.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from datetime import date

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .. import strict_json
from ..config import load_config
from ..costs.hardware import get_hardware
from ..errors import ConfigError
from ..job import comm
from ..job.devices import machine_record
from ..job.host_malloc import keep_freed_blocks
from ..job.spawn import run_spawned
from ..models.moe import MoEFeedForward
from ..parallel.expert.install import use_expert_parallel
from ..parallel.expert.placement import Placement, plan_placement
from ..progress import phase, speaker
from .emulated_link import LinkProfile, emulate, parse_cluster


def add_arguments(p) -> None:
    p.add_argument("--cluster", default="", help="NODESxRANKS, e.g. 2x4: the emulated-cluster benchmark")
    p.add_argument("--model", default="small-moe", help="--cluster: the MoE preset whose layers run")
    p.add_argument("--layers", type=int, default=2, help="--cluster: MoE layers in the step (0 = all of the model's)")
    p.add_argument("--tokens", type=int, default=8192,
                   help="--cluster: tokens per rank per step (its share of a long sequence)")
    p.add_argument("--hardware", default="h100", help="--cluster: planner hardware whose links are emulated")
    p.add_argument("--inter-ratio", type=float, default=0.0,
                   help="--cluster: inter-node / intra-node bandwidth (0 = the hardware's)")
    p.add_argument("--slowdown", default="auto",
                   help="--cluster: how much slower than the hardware this machine computes (auto = measured)")
    p.add_argument("--link-scale", type=float, default=1.0,
                   help="--cluster: links this many times faster than the hardware's (e.g. to put communication "
                        "at a chosen share of the step)")
    p.add_argument("--chunks", default="2,4", help="--cluster: pipelined chunk counts to time (comma-separated)")
    p.add_argument("--no-emulation", action="store_true", help="--cluster: real links only (a real cluster)")
    p.add_argument("--zipf", type=float, default=1.2,
                   help="--cluster: the skewed-routing runs' Zipf exponent over the experts (0 = no skewed runs)")
    p.add_argument("--replicas", type=int, default=1,
                   help="--cluster: FlexMoE copy slots per rank in the skewed runs (parallel.expert_replicas)")


say = speaker("[bench moe --cluster] ")


def _gemm_rate(rows: int, dim: int, hidden: int, mesh, repeats: int = 6) -> float:
    """FLOP/s of expert-sized GEMMs on one rank while every rank runs them (they share the cores):
    the wall time of all the repeats from a common start, not the best one."""
    a, b = torch.randn(rows, dim), torch.randn(dim, hidden)
    a @ b
    comm.barrier(mesh)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * rows * dim * hidden * repeats / (time.perf_counter() - t0)


def _step(stack, x, grad) -> None:
    h = x
    for layer in stack:
        h = h + layer(h)
    h.backward(grad)


def _rank(spec: dict) -> dict:
    keep_freed_blocks()  # as `longctx train` runs on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(None, [f"--model.preset={spec['model']}"]).model
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("expert_data", "expert"))
    torch.manual_seed(0)
    base = nn.ModuleList(MoEFeedForward(cfg) for _ in range(spec["layers"]))
    for p in base.parameters():
        nn.init.normal_(p, std=0.02)
    tokens = spec["tokens"]
    gen = torch.Generator().manual_seed(1000 + rank)
    # hidden states inside a model: they need a gradient (the layer sends the rows' gradients back)
    x = torch.randn(tokens, cfg.dim, generator=gen).requires_grad_()
    grad = torch.randn(tokens, cfg.dim, generator=gen)
    hw = get_hardware(spec["hardware"])
    expert_mesh = comm.sub_mesh(mesh, "expert")
    rate = _gemm_rate(tokens * cfg.moe_top_k, cfg.dim, cfg.resolved_expert_dim, expert_mesh)
    mean_rate = comm.all_reduce(torch.tensor([rate], dtype=torch.float64), expert_mesh).item() / world
    slowdown = spec["slowdown"] or hw.peak_flops * hw.gemm_efficiency / mean_rate
    # the rows travel here in fp32 where the hardware would send hw.dtype_bytes per value: the links
    # are widened by that ratio, so a row takes the time it would take there
    profile = LinkProfile.from_hardware(hw, spec["ranks_per_node"], slowdown, ("expert", "expert_node", "expert_local"),
                                        faster=spec["link_scale"],
                                        widen=x.element_size() / hw.dtype_bytes, inter_ratio=spec["inter_ratio"])
    out = {"slowdown": slowdown, "rank_gemm_flops": rate, "profile": dataclasses.asdict(profile),
           "schedules": {}}
    for name, chunks in spec["schedules"]:
        stack = copy.deepcopy(base)
        use_expert_parallel(stack, mesh, chunks)
        out["schedules"][name] = _time(stack, x, grad, spec, profile, expert_mesh)
    if spec["ranks_per_node"] < world:  # the sequential schedule with hierarchical dispatch
        stack = copy.deepcopy(base)
        use_expert_parallel(stack, mesh, 1, ranks_per_node=spec["ranks_per_node"])
        out["hierarchical"] = _time(stack, x, grad, spec, profile, expert_mesh)
    if spec["zipf"]:
        out["skew"] = _skewed_runs(spec, base, x, grad, profile, mean_rate, mesh)
    return out


def _time(stack, x, grad, spec, profile, mesh) -> list[dict]:
    """The step of `stack` timed spec["repeats"] times after a warm-up, under the emulated links
    (unless --no-emulation): each repeat's step time, exposed time and bytes sent across nodes."""
    _step(stack, x, grad)  # warm-up
    runs = []
    for _ in range(spec["repeats"]):
        stack.zero_grad(set_to_none=True)
        comm.barrier(mesh)
        t0 = time.monotonic()
        if spec["emulate"]:
            with emulate(profile) as emu:
                _step(stack, x, grad)
            exposed, inter = emu.exposed_s, emu.sent["inter"]
        else:
            _step(stack, x, grad)
            exposed, inter = float("nan"), None  # (only the emulated links count: not measured, not 0)
        runs.append({"step_s": time.monotonic() - t0, "exposed_s": exposed, "cross_node_bytes": inter})
    return runs


def _zipf_routing(stack, tokens: int, experts: int, s: float, seed: int) -> None:
    """Every layer's router picks each token's experts as a draw without replacement from Zipf(s)
    over the experts (Gumbel top-k on log p), a fixed draw per layer and rank; the logits keep
    their graph (zero times the real ones) so the layer runs as in training."""
    p = torch.tensor([(i + 1) ** -s for i in range(experts)], dtype=torch.float64)
    logp = (p / p.sum()).log().float()
    gen = torch.Generator().manual_seed(seed)
    for layer in stack:
        gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen).clamp_min(1e-20)))
        fixed, choose = logp + gumbel, layer.router.choose
        layer.router.choose = lambda logits, chosen=None, f=fixed, c=choose: c(logits * 0 + f, chosen)


def _rank_rows(placements, counts: torch.Tensor, mesh) -> list[int]:
    """Rows each rank of the group runs, over the layers: every rank's cut of its own rows by the
    placement, summed over the senders."""
    total = 0
    for placement, c in zip(placements, counts.tolist()):
        per_slot = torch.tensor(placement.slot_counts([int(v) for v in c]), dtype=torch.float64)
        total = total + comm.all_reduce(per_slot, mesh).view(placement.ep, -1).sum(1)
    return total.tolist()


HEADROOM = 1.5  # emulated devices this much slower than the measured rate, so real GEMMs fit inside


def _skewed_runs(spec, base, x, grad, profile, mean_rate, mesh) -> dict:
    """Static placement vs FlexMoE's under Zipf routing, on emulated devices: each rank's expert
    GEMMs take the time a device of `mean_rate / HEADROOM` would (emulated_link.paced), even when
    its neighbours idle, and the links are slowed by the same factor, so a straggler costs the
    group what it costs on a cluster. The placement comes from a first step's counts over the group
    (what the placer sees over its window in training)."""
    expert_mesh = comm.sub_mesh(mesh, "expert")
    world = expert_mesh.size()
    stack = copy.deepcopy(base)
    experts = stack[0].num_experts
    _zipf_routing(stack, x.shape[0], experts, spec["zipf"], 7000 + comm.local_rank(expert_mesh))
    use_expert_parallel(stack, mesh, 1)
    for layer in stack:
        layer.recording = True
    _step(stack, x, grad)
    counts = torch.stack([sum(r.counts for r in layer.records) for layer in stack])
    for layer in stack:
        layer.recording, layer.records = False, []
    global_counts = comm.all_reduce(counts.double(), expert_mesh)
    static = [Placement.static(experts, world)] * len(stack)
    placed = [plan_placement(c, world, spec["replicas"]) for c in global_counts.tolist()]
    paced = dataclasses.replace(profile, compute_flops=mean_rate / HEADROOM,
                                intra_bytes_per_s=profile.intra_bytes_per_s / HEADROOM,
                                inter_bytes_per_s=profile.inter_bytes_per_s / HEADROOM,
                                intra_latency_s=profile.intra_latency_s * HEADROOM,
                                inter_latency_s=profile.inter_latency_s * HEADROOM)
    out = {"copies": sum(p.copies for p in placed), "compute_flops": paced.compute_flops}
    for name, placements in (("static", static), ("flexmoe", placed)):
        for layer, placement in zip(stack, placements):
            layer.experts.placement = placement
        rows = _rank_rows(placements, counts, expert_mesh)
        out[name] = {"rows": rows, "max_over_mean": max(rows) / (sum(rows) / len(rows)),
                     "runs": _time(stack, x, grad, spec, paced, expert_mesh)}
    return out


def main(args) -> int:
    nodes, per_node = parse_cluster(args.cluster)
    world = nodes * per_node
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if any(c < 2 for c in chunks):
        raise ConfigError(f"--chunks {args.chunks}: pipelined chunk counts are >= 2.")
    spec = {"model": args.model, "layers": args.layers, "tokens": args.tokens, "hardware": args.hardware,
            "ranks_per_node": per_node, "inter_ratio": args.inter_ratio, "repeats": args.repeats,
            "link_scale": args.link_scale, "zipf": args.zipf, "replicas": args.replicas,
            "slowdown": 0.0 if args.slowdown == "auto" else float(args.slowdown), "emulate": not args.no_emulation,
            "schedules": [("sequential", 1), *((f"scheduled_{c}", c) for c in chunks)]}
    if not spec["layers"]:
        spec["layers"] = len(load_config(None, [f"--model.preset={args.model}"]).model.moe_layer_ids)
    say(f"{world} ranks ({nodes} nodes x {per_node}), {args.model}: {spec['layers']} MoE layers, "
              f"{args.tokens:,} tokens, schedules {[n for n, _ in spec['schedules']]}, {args.repeats} repeats")
    with phase(f"bench moe --cluster on {world} ranks"):  # said while it runs, when that is long
        per_rank = run_spawned(world, _rank, spec)
    doc = summarize(per_rank, spec)
    doc.update({"bench": "moe_cluster", "date": date.today().isoformat(), "cluster": f"{nodes}x{per_node}",
                "machine": machine_record()})
    print(strict_json.dumps(doc, indent=2))
    return 0


def _slowest(runs: list[dict]) -> dict:
    """One repeat over the ranks: the slowest rank's step time and the exposed time of THAT rank (not
    the largest over the ranks: a rank that waits longest on the links is rarely the slowest one), and
    every rank's cross-node bytes summed (None where they were not counted: --no-emulation)."""
    slow = max(runs, key=lambda r: r["step_s"])
    counted = [r["cross_node_bytes"] for r in runs]
    return {"step_s": slow["step_s"], "exposed_s": slow["exposed_s"],
            "cross_node_bytes": None if None in counted else sum(counted)}


def summarize(per_rank: list[dict], spec: dict) -> dict:
    """Per schedule: each repeat's step time and exposed time are the slowest rank's; the repeat with
    the least step time is the figure."""
    table = {}
    for name, _ in spec["schedules"]:
        repeats = [_slowest([r["schedules"][name][i] for r in per_rank]) for i in range(spec["repeats"])]
        table[name] = min(repeats, key=lambda r: r["step_s"]) | {"repeats": repeats}
    scheduled = [n for n, _ in spec["schedules"] if n != "sequential"]
    best = min(scheduled, key=lambda n: table[n]["step_s"]) if scheduled else "sequential"
    seq = table["sequential"]
    return {
        "config": {k: v for k, v in spec.items() if k != "schedules"} | {"slowdown": per_rank[0]["slowdown"],
                                                                           "link": per_rank[0]["profile"]},
        "sequential_s": seq["step_s"], "scheduled_s": table[best]["step_s"],
        "scheduled_chunks": dict(spec["schedules"])[best],
        "exposed_comm_sequential": seq["exposed_s"], "exposed_comm_scheduled": table[best]["exposed_s"],
        "step_ratio": table[best]["step_s"] / seq["step_s"],
        "exposed_ratio": table[best]["exposed_s"] / seq["exposed_s"] if seq["exposed_s"] else None,
        "cross_node_bytes_flat": seq["cross_node_bytes"],
        "schedules": table,
        **(_hierarchical_summary(per_rank, spec, seq) if "hierarchical" in per_rank[0] else {}),
        **(_skew_summary(per_rank, spec) if spec["zipf"] else {}),
    }


def _hierarchical_summary(per_rank: list[dict], spec: dict, seq: dict) -> dict:
    """The sequential schedule with hierarchical dispatch: bytes sent across nodes per step (every
    rank's), against the flat exchange's, and its step time."""
    repeats = [_slowest([r["hierarchical"][i] for r in per_rank]) for i in range(spec["repeats"])]
    best = min(repeats, key=lambda r: r["step_s"])
    return {"cross_node_bytes_hierarchical": best["cross_node_bytes"],
            "cross_node_ratio": best["cross_node_bytes"] / seq["cross_node_bytes"] if seq["cross_node_bytes"] else None,
            "hierarchical_s": best["step_s"], "exposed_comm_hierarchical": best["exposed_s"]}


def _skew_summary(per_rank: list[dict], spec: dict) -> dict:
    """The skewed runs: per placement, the rows' max / mean over the ranks and the least of the
    repeats' step times (each repeat's the slowest rank's)."""
    skew = per_rank[0]["skew"]
    step = {name: min(max(r["skew"][name]["runs"][i]["step_s"] for r in per_rank) for i in range(spec["repeats"]))
            for name in ("static", "flexmoe")}
    return {"skew_max_load_static": skew["static"]["max_over_mean"],
            "skew_max_load_flexmoe": skew["flexmoe"]["max_over_mean"],
            "skew_step_static_s": step["static"], "skew_step_flexmoe_s": step["flexmoe"],
            "skew_step_ratio": step["flexmoe"] / step["static"],
            "skew": {"zipf": spec["zipf"], "replicas": spec["replicas"], "copies": skew["copies"],
                     "emulated_device_flops": skew["compute_flops"],
                     "rows_static": skew["static"]["rows"], "rows_flexmoe": skew["flexmoe"]["rows"]}}
