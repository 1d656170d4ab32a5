"""Hierarchical expert dispatch (parallel/expert/hierarchy.py) against the flat exchange: one MoE
layer on 4 expert ranks seen as 2 nodes of 2, outputs and every gradient (routing weights' included,
through the router) within 1e-5, with pipelined chunks, capacity drops and skewed routing; and the
bytes that cross nodes, counted by the emulated link, below the flat exchange's. Training under
expert 4 x (head 2 x ctx 2) with it is in test_expert_parallel.py (LAYOUTS)."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from longctx.bench.emulated_link import LinkProfile, emulate
from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned
from longctx.models.moe import MoEFeedForward
from longctx.parallel.expert.install import use_expert_parallel


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _compare(case: str):
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    cfg = ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_top_k=3, moe_expert_dim=48, moe_router="softmax",
                      moe_capacity_factor=1.0 if case == "capacity" else 0.0, moe_shared_experts=1, moe_shared_dim=32)
    torch.manual_seed(0)
    base = MoEFeedForward(cfg)
    for p in base.experts.parameters():
        nn.init.normal_(p, std=0.05)
    if case == "skewed":
        base.router.expert_bias[5] = 50.0  # every token's first choice on node 1
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(50 + 7 * rank, 32, generator=gen)
    grad = torch.randn(50 + 7 * rank, 32, generator=gen)
    # links fast enough not to matter: the emulator is here to count what crosses nodes
    profile = LinkProfile(ranks_per_node=2, intra_bytes_per_s=1e15, inter_bytes_per_s=1e15)
    out, inter = {}, {}
    for name, chunks, nodes in (("flat", 1, 0), ("hierarchical", 1, 2), ("hierarchical-pipeline3", 3, 2)):
        holder = nn.Sequential(copy.deepcopy(base))
        use_expert_parallel(holder, mesh, chunks, ranks_per_node=nodes)
        xi = x.clone().requires_grad_()
        with emulate(profile) as emu:
            y = holder[0](xi)
            y.backward(grad)
        inter[name] = emu.sent["inter"]
        out[name] = {"y": y.detach(), "x": xi.grad,
                     **{n: _local(p.grad).clone() for n, p in holder[0].named_parameters()}}
    worst = {name: max((out[name][k] - out["flat"][k]).abs().max().item() for k in out["flat"])
             for name in ("hierarchical", "hierarchical-pipeline3")}
    return worst, sorted(out["flat"]), inter


CASES = ("uniform", "skewed", "capacity")


def _all_cases():
    return {case: _compare(case) for case in CASES}


@pytest.fixture(scope="module")
def compared():
    """Every case in one 4-rank job (starting ranks costs seconds): {case: per-rank results}."""
    per_rank = run_spawned(4, _all_cases)
    return {case: [r[case] for r in per_rank] for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_hierarchical_dispatch_matches_the_flat_exchange_and_sends_less_across_nodes(case, compared):
    results = compared[case]
    flat = sum(r[2]["flat"] for r in results)
    hier = sum(r[2]["hierarchical"] for r in results)
    print(f"{case}: cross-node bytes hierarchical / flat = {hier} / {flat} = {hier / flat:.3f}")
    for worst, keys, _ in results:
        assert {"y", "x", "experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= set(keys)
        assert max(worst.values()) <= 1e-5, worst
    # top-3 of 8 experts on 2 nodes: a token uses both nodes or one, never sends a row to a node twice
    assert 0 < hier < 0.85 * flat
