"""One MoE layer under expert parallelism (4 ranks, gloo), skewed routing (a selection bias sends most first
choices to two experts) and a capacity that drops most of their choices: every dispatcher (flat, FSMoE's
pipelined chunks, FlexMoE's copies with and without chunks, hierarchical over 2 nodes with and without chunks)
gives each rank's outputs, input gradient, router and shared-expert gradients and the expert weights' gradients
(summed over the ranks, as FSDP's average over the 1 / group scale makes them) of one process running every
rank's tokens through the unsplit layer with the same drops, within fp32 rounding. Routers: softmax top-2
renormalised with a gated shared expert, softmax top-3 unnormalised, switch, sigmoid top-2."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from longctx.config import ModelConfig
from longctx.job import comm
from longctx.job.spawn import run_spawned
from longctx.models.moe import MoEFeedForward
from longctx.parallel.expert.install import use_expert_parallel
from longctx.parallel.expert.placement import plan_placement

CASES = {
    "softmax-top2-norm-cap1-shared": dict(moe_router="softmax", moe_top_k=2, moe_norm_topk=True,
                                          moe_capacity_factor=1.0, moe_shared_dim=40, moe_shared_gate=True),
    "softmax-top3-cap0.5": dict(moe_router="softmax", moe_top_k=3, moe_norm_topk=False, moe_capacity_factor=0.5),
    "switch-cap1": dict(moe_router="switch", moe_top_k=1, moe_capacity_factor=1.0),
    "sigmoid-top2-cap1.25": dict(moe_router="sigmoid", moe_top_k=2, moe_norm_topk=True, moe_capacity_factor=1.25),
}
VARIANTS = {  # name: (pipeline chunks, copy slots per rank, ranks per node)
    "flat": (1, 0, 0), "pipeline3": (3, 0, 0), "copies2": (1, 2, 0), "copies2-pipeline3": (3, 2, 0),
    "hier2": (1, 0, 2), "hier2-pipeline2": (2, 0, 2)}
EXPERT_WEIGHTS = ("experts.w1", "experts.w2", "experts.w3")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _case(kw):
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    group, rank = comm.sub_mesh(mesh, "expert"), torch.distributed.get_rank()
    torch.manual_seed(0)
    base = MoEFeedForward(ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_expert_dim=48, **kw))
    for p in base.parameters():
        nn.init.normal_(p, std=0.2)
    base.router.expert_bias[0], base.router.expert_bias[5] = 5.0, 2.5
    gen = torch.Generator().manual_seed(100 + rank)
    x, grad = torch.randn(50 + 9 * rank, 32, generator=gen), torch.randn(50 + 9 * rank, 32, generator=gen)
    ref, xr = copy.deepcopy(base), x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(grad)
    want = {"y": yr.detach(), "x": xr.grad, **{k: p.grad for k, p in ref.named_parameters()}}
    for k in EXPERT_WEIGHTS:  # the one process's gradient of this rank's experts, over every rank's tokens
        want[k] = comm.all_reduce(want[k], group).chunk(4, 0)[rank] / 4
    with torch.no_grad():
        routing = base.route(x)
        counts = comm.all_reduce(torch.bincount(routing.experts.flatten(), minlength=8).float(), group)
        dropped = comm.all_reduce((~routing.kept).sum().float(), group).item()
    worst = {}
    for name, (chunks, replicas, per_node) in VARIANTS.items():
        holder = nn.Sequential(copy.deepcopy(base))
        use_expert_parallel(holder, mesh, chunks, replicas=replicas, ranks_per_node=per_node)
        if replicas:
            holder[0].experts.placement = plan_placement(counts.tolist(), 4, replicas)
        xi = x.clone().requires_grad_()
        y = holder[0](xi)
        y.backward(grad)
        got = {"y": y.detach(), "x": xi.grad, **{k: _local(p.grad) for k, p in holder[0].named_parameters()}}
        assert set(got) == set(want)
        worst[name] = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst, dropped / (counts.sum().item())


def _all():
    return {name: _case(kw) for name, kw in CASES.items()}


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(4, _all)


@pytest.mark.parametrize("case", list(CASES))
def test_every_dispatcher_drops_and_trains_as_one_process_under_skew(case, per_rank):
    for rank, results in enumerate(per_rank):
        worst, drop_rate = results[case]
        print(f"{case} rank {rank}: drop rate {drop_rate:.2f}, worst |diff| {max(worst.values()):.1e}")
        assert drop_rate > 0.2  # the capacity binds
        assert max(worst.values()) <= 1e-5, worst
