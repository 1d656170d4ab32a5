"""FlexMoE's placement (parallel/expert/placement.py): the policy balances a Zipf load within the
copy slots it has, the slot cut sends every row once to a holder of its expert, and one MoE layer
on 4 expert ranks with copies gives the outputs and every gradient of the plain expert-parallel
layer (1e-5), with and without pipelined chunks. Training with a placement that changes mid-run,
and a resume across placements, are in test_expert_parallel.py."""

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
from longctx.parallel.expert.placement import ExpertPlacer, Placement, plan_placement


def _zipf_load(experts=16, tokens=20000, s=1.2, seed=0):
    """Top-2 choices sampled without replacement from Zipf(s) over the experts (Gumbel top-k)."""
    p = torch.tensor([(i + 1) ** -s for i in range(experts)])
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g)))
    chosen = ((p / p.sum()).log() + gumbel).topk(2, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=experts).tolist()


def _rank_rows(placement, counts):
    per_slot = placement.slot_counts(counts)
    return [sum(per_slot[q * placement.slots:(q + 1) * placement.slots]) for q in range(placement.ep)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_policy_balances_a_zipf_load_within_its_slots(replicas):
    load = _zipf_load()
    static = _rank_rows(Placement.static(16, 8), load)
    placement = plan_placement(load, 8, replicas)
    rows = _rank_rows(placement, load)
    mean = sum(load) / 8
    assert max(static) / mean > 3  # the skew is real: the owner of experts 0 and 1
    assert max(rows) / mean <= 1.15, rows
    assert sum(rows) == sum(load)
    for q, row in enumerate(placement.slot_expert):  # a rank's own experts stay; copies fit its slots
        assert row[:2] == (2 * q, 2 * q + 1) and len(row) == 2 + replicas
    for e, holders in enumerate(placement.holders):
        assert holders[0][0] == e // 2 and sum(share for _, _, share in holders) == pytest.approx(1.0)
        assert all(placement.slot_expert[q][s] == e for q, s, _ in holders)
    assert placement.predicted["max_over_mean_after"] == pytest.approx(max(rows) / mean, rel=1e-3)


def test_an_even_load_gets_no_copies():
    placement = plan_placement([100] * 8, 4, 2)
    assert placement.copies == 0 and placement.predicted["max_over_mean_after"] == 1.0


def test_the_slot_order_sends_every_row_once_to_a_holder_of_its_expert():
    counts = [7, 0, 3, 11, 1, 5, 2, 9]
    placement = plan_placement([50, 1, 2, 30, 1, 1, 1, 40], 4, 1)
    assert placement.copies > 0
    order = placement.slot_order(counts).tolist()
    assert sorted(order) == list(range(sum(counts)))
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    per_slot, start = placement.slot_counts(counts), 0
    for flat, n in enumerate(per_slot):
        q, s = divmod(flat, placement.slots)
        assert {expert_of_row[i] for i in order[start:start + n]} <= {placement.slot_expert[q][s]}
        start += n


def test_the_placer_re_places_at_the_end_of_each_window_only():
    class _Experts:
        w1 = torch.zeros(8, 6, 4)
        placement = None

    class _Layer:
        experts = _Experts()

    layers = [_Layer()]
    placer = ExpertPlacer(layers, 4, 1, window=3)
    skewed = torch.tensor([[90.0, 1, 1, 1, 1, 1, 1, 1]])
    assert placer.observe(skewed) is None and placer.observe(skewed) is None
    assert layers[0].experts.placement is None
    line = placer.observe(skewed)
    assert "copies" in line and layers[0].experts.placement.copies > 0


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _compare(skew: float):
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    cfg = ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_top_k=2, moe_expert_dim=48, moe_router="softmax")
    torch.manual_seed(0)
    base = MoEFeedForward(cfg)
    for p in base.experts.parameters():
        nn.init.normal_(p, std=0.05)
    base.router.expert_bias[0] = skew
    base.router.expert_bias[3] = skew / 2
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(60 + 7 * rank, 32, generator=gen)
    grad = torch.randn(60 + 7 * rank, 32, generator=gen)
    with torch.no_grad():  # the placement from the whole group's counts, as the placer's are
        counts = torch.bincount(base.router(x).experts.flatten(), minlength=8).float()
    counts = comm.all_reduce(counts, comm.sub_mesh(mesh, "expert"))
    out = {}
    for name, chunks, placed in (("plain", 1, False), ("placed", 1, True), ("placed-pipeline3", 3, True)):
        holder = nn.Sequential(copy.deepcopy(base))
        use_expert_parallel(holder, mesh, chunks)
        if placed:
            holder[0].experts.placement = plan_placement(counts.tolist(), 4, 1)
        xi = x.clone().requires_grad_()
        y = holder[0](xi)
        y.backward(grad)
        out[name] = {"y": y.detach(), "x": xi.grad,
                     **{n: _local(p.grad).clone() for n, p in holder[0].named_parameters()}}
    worst = {name: max((out[name][k] - out["plain"][k]).abs().max().item() for k in out["plain"])
             for name in ("placed", "placed-pipeline3")}
    return worst, sorted(out["plain"]), plan_placement(counts.tolist(), 4, 1).copies


def _both():
    return {skew: _compare(skew) for skew in (0.0, 3.0)}


@pytest.fixture(scope="module")
def compared():
    per_rank = run_spawned(4, _both)  # both cases in one job (starting ranks costs seconds)
    return {skew: [r[skew] for r in per_rank] for skew in (0.0, 3.0)}


@pytest.mark.parametrize("skew", [0.0, 3.0], ids=["uniform", "skewed"])
def test_a_layer_with_copies_matches_the_plain_expert_parallel_layer(skew, compared):
    for worst, keys, copies in compared[skew]:
        assert {"y", "x", "experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= set(keys)
        assert max(worst.values()) <= 1e-5, worst
        if skew:
            assert copies > 0
