"""The planner's bytes per link level cover expert layouts (planner/expert_levels.py, called by
planner/slow_links.py link_level_bytes): which hops an exchange's or a ring's groups take, by hand; an expert
plan's per-level bytes are the dense part plus every rank's expert exchange on the level its group spans (flat:
4 of a rank's 7 peers on the other node; hierarchical: the node exchange across nodes, the local one inside);
the routers' own fp32 units where blocks gather bf16; `longctx plan`'s report gives them; the layouts still not
described say why. (Against what ranks send: tests/distributed/test_linklevels109_ranks.py.)"""

import dataclasses
from fractions import Fraction

import pytest

from longctx.config import load_config
from longctx.costs.hardware import load_hardware
from longctx.costs.link_bytes import layout_bytes
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import estimate
from longctx.planner.expert_levels import (
    expert_sent_per_micro_batch,
    peer_shares,
    ring_hops,
    router_unit_levels,
    why_not_described,
)
from longctx.planner.link_report import levels_of, report, report_text
from longctx.planner.request import Request
from longctx.planner.search import plan
from longctx.planner.slow_links import link_level_bytes, planner_units

MODEL = load_config(None, ["--model.preset=debug-moe"]).model  # 8 experts, top-2, 3 MoE layers of 4
HW = load_hardware("h100", [], world=8)  # bf16 gathers; inter-node 50 GB/s, intra-node 450
NONE = MemoryPolicy("none")
SEQ = 8192
F = Fraction


def test_which_hops_an_exchanges_groups_take():
    """8 ranks in nodes of 4: summed over the ranks, the shares of their peers across nodes / inside."""
    assert peer_shares(8, 1, 8, 4) == (8 * F(4, 7), 8 * F(3, 7), 0)  # flat ep8: 4 of 7 peers on the other node
    assert peer_shares(8, 1, 4, 4) == (0, 8, 0)  # ep4: a node's
    assert peer_shares(8, 4, 2, 4) == (8, 0, 0)  # ep8 over nodes of 4: "expert_node" (stride 4)
    assert peer_shares(8, 1, 4, 4, group=2) == (0, 8 * F(2, 3), 8 * F(1, 3))  # 1 of 3 peers in its group of 2
    assert peer_shares(8, 1, 1, 4) == (0, 0, 0)
    # expert-data rings: ep2 -> 2 rings 0-2-4-6 (2 of 4 hops cross), ep4 -> 4 rings of 2 (both hops cross)
    assert ring_hops(8, 2, 4, 4) == (4, 4, 0)
    assert ring_hops(8, 4, 2, 4) == (8, 0, 0)
    assert ring_hops(8, 1, 8, 4) == (2, 6, 0)  # consecutive ranks: the loss's ring


def _pair():
    shapes = {r: MeshShape(dp_shard=4, ctx=2, expert=8, expert_ranks_per_node=r) for r in (0, 4)}
    return {r: estimate(MODEL, HW, s, NONE, seq_len=SEQ, global_batch=4, gpus_per_node=4, expert_skew=1.0)
            for r, s in shapes.items()}


def _levels(e):
    return link_level_bytes(MODEL, e.mesh_shape, HW, 4, expert_sent_per_micro_batch(e.comm_bytes, e.grad_accum))


def test_an_expert_plans_levels_are_its_dense_part_and_every_ranks_exchange():
    """ep8 on 2 nodes of 4 (expert-data 1: no expert units' bytes): flat, each rank's exchange 4/7 across nodes;
    hierarchical over nodes of 4, the node exchange all across, the local one all inside. The rest (the dense
    units, routers apart: bf16 gathers; the loss's and the router statistics' all-reduces) is the same."""
    est = _pair()
    flat, hier = _levels(est[0]), _levels(est[4])
    per_rank = {r: {d: sum(v.values()) / e.grad_accum for d, v in e.comm_bytes.items()} for r, e in est.items()}
    rest_inter = flat["inter_node_bytes"] - 8 * 4 / 7 * per_rank[0]["expert"]
    rest_intra = flat["intra_node_bytes"] - 8 * 3 / 7 * per_rank[0]["expert"]
    assert hier["inter_node_bytes"] == pytest.approx(rest_inter + 8 * per_rank[4]["expert_node"], abs=1)
    assert hier["intra_node_bytes"] == pytest.approx(rest_intra + 8 * per_rank[4]["expert_local"], abs=1)
    assert hier["inter_node_bytes"] < flat["inter_node_bytes"]
    # the rest by hand: layout_bytes of the dense units (bf16) and the routers' (fp32, less their loss), and the
    # router statistics' all-reduce: 3 x 3 x 8 + 2 x 3 + 1 = 79 fp32, 2 x 316 x 7 // 8 = 553 B a rank, 2 of 8 hops
    dense = layout_bytes("fsdp", planner_units(MODEL, 8, 4, parts=("dense",)), 2, 4, 1, gather_bytes=2)
    routers = router_unit_levels(planner_units(MODEL, 8, 4, parts=("router",)), est[0].mesh_shape, 2, 4)
    assert rest_inter == pytest.approx(dense["inter_node_bytes"] + routers[0] + 2 * 553, abs=1)
    assert rest_intra == pytest.approx(dense["intra_node_bytes"] + routers[1] + 6 * 553, abs=1)
    assert flat["intra_group_bytes"] == hier["intra_group_bytes"] == 0


def test_routers_are_gathered_in_fp32_where_the_blocks_gather_bf16():
    """debug-moe's 3 routers [8, 128] over 4 ranks of one node: 256 elements a rank each, gathered twice in fp32
    and reduce-scattered in fp32, 3 x 4 x (2 x 4 + 4) x 256 x 3 bytes, all inside the node."""
    got = router_unit_levels(planner_units(MODEL, 4, 4, parts=("router",)), MeshShape(dp_shard=4, expert=4), 1, 4)
    assert got == [0, 3 * 4 * 12 * 256 * 3, 0]


def test_the_plan_report_gives_an_expert_plans_bytes_per_level():
    req = Request(MODEL, HW, 8, SEQ, gpus_per_node=4, expert_degrees=(8,), recomputes=("none",),
                  micro_batches=(1,), expert_skew=1.0, expert_ranks_per_node=4)
    res = plan(req, explain=False)
    assert res.best.mesh_shape.expert_ranks_per_node == 4
    levels = report(res)["bytes_per_level"]
    assert levels is not None and levels == levels_of(res.best, req) and levels["inter_node_bytes"] > 0
    assert any(line.startswith("slow links: bytes per link level, inter-node") and "expert all-to-alls" in line
               for line in report_text(res))


@pytest.mark.parametrize("change, reason", [
    (dict(expert_replicas=1), "FlexMoE's copies"),
    (dict(dp_replicate=2, dp_shard=2, data_parallel="co2", local_steps=2), "co2 under expert parallelism"),
])
def test_layouts_still_not_described_say_why(change, reason):
    e = _pair()[0]
    shape = dataclasses.replace(e.mesh_shape, **change)
    sent = expert_sent_per_micro_batch(e.comm_bytes, e.grad_accum)
    assert reason in why_not_described(MODEL, shape, sent)
    assert link_level_bytes(MODEL, shape, HW, 4, sent) is None
    # without the plan's per-rank expert bytes, and under routing across tokens (a capacity)
    assert link_level_bytes(MODEL, e.mesh_shape, HW, 4) is None
    capacity = dataclasses.replace(MODEL, moe_capacity_factor=1.25)
    assert "across tokens" in why_not_described(capacity, e.mesh_shape, sent)
    assert link_level_bytes(capacity, MeshShape(dp_shard=8), HW, 4) is None  # its gathers run at expert 1 too
    assert link_level_bytes(MODEL, MeshShape(dp_shard=8), HW, 4) is not None
