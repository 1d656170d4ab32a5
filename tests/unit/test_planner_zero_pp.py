"""The planner's parallel.zero_pp (ZeRO++, issue 50 item 4): FSDP transfer times per mode against
closed forms worked out by hand, hpz's node-sharded copy in the memory, ZeRO++ tried only where the
FSDP group spans nodes, ties to plain FSDP, and a chosen plan that `longctx train` accepts."""

import dataclasses

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.host_bytes import device_bytes
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape
from longctx.costs.timing import fsdp_transfer_seconds, quantized_bytes
from longctx.planner.output import plan_config, runnable
from longctx.planner.search import Request, candidate_shapes, plan

H100 = PRESETS["h100"]
M = load_config(None, {"model": {"preset": "llama3-8b"}}).model
INTRA, INTER = H100.intra_gbps * 1e9, H100.inter_gbps * 1e9


def test_transfer_seconds_per_mode_follow_the_closed_forms():
    """64 ranks of FSDP over 8 nodes of 8, one block of b parameters, bf16 gathers (2 bytes)."""
    b = param_counts(M)["block"]
    q = 1 + 4 / 512  # int8 and one fp32 scale per 512
    plain = fsdp_transfer_seconds(M, MeshShape(dp_shard=64), 2, H100, 8)
    assert plain["block_gather"] == plain["block_gather_bwd"] == pytest.approx(63 / 64 * b * 2 / INTER)
    assert plain["block_reduce"] == pytest.approx(63 / 64 * b * 4 / INTER)
    zpp = fsdp_transfer_seconds(M, MeshShape(dp_shard=64, zero_pp="hpz,qwz,qgz", node=8), 2, H100, 8)
    assert quantized_bytes(MeshShape(dp_shard=64, zero_pp="qwz")) == q  # the default parallel.zero_pp_block
    assert zpp["block_gather"] == pytest.approx(63 / 64 * b * q / INTER)       # qwz, across nodes
    assert zpp["block_gather_bwd"] == pytest.approx(7 / 8 * b * 2 / INTRA)    # hpz: in the node, bf16
    # qgz: int8 to the 7 node peers, then the node sums (b / 8) to the 7 other nodes
    assert zpp["block_reduce"] == pytest.approx(7 / 8 * b * q / INTRA + 7 / 8 * b / 8 * q / INTER)
    assert zpp["block_reduce"] < plain["block_reduce"] / 3


def test_hpz_keeps_a_node_sharded_copy_of_the_blocks():
    pc = param_counts(M)
    args = ("device", "step", 1, 2, 0.0, 0.0)
    plain = device_bytes(M, MeshShape(dp_shard=64), *args)
    hpz = device_bytes(M, MeshShape(dp_shard=64, zero_pp="hpz", node=8), *args)
    assert hpz["gathered_params"] - plain["gathered_params"] == pytest.approx((pc["total"] - pc["root"]) * 2 / 8)
    assert hpz["total"] - plain["total"] == pytest.approx((pc["total"] - pc["root"]) * 2 / 8)


def test_zero_pp_is_tried_only_where_the_fsdp_group_spans_nodes():
    shapes = candidate_shapes(Request(M, H100, 16, 2**17, gpus_per_node=8))
    with_zpp = [s for s in shapes if s.zero_pp]
    assert with_zpp and all(s.fsdp > 8 and s.node == 8 for s in with_zpp)
    assert {dataclasses.replace(s, zero_pp="", node=0) for s in with_zpp} <= set(shapes)
    assert not any(s.zero_pp for s in candidate_shapes(Request(M, H100, 8, 2**17, gpus_per_node=8)))


def test_a_slow_inter_node_link_makes_zero_pp_pay_and_its_plan_runs(monkeypatch):
    """llama3-70b on 32 GPUs in 4 nodes at 5 GB/s between them: the states need FSDP over more than a
    node (HSDP within one would hold 140 GB per GPU), so the weights' and gradients' transfers cross
    the slow link every step; ZeRO++ sends about a quarter of their bytes across, and wins."""
    import longctx.planner.request as request

    m70 = load_config(None, {"model": {"preset": "llama3-70b"}}).model
    req = Request(m70, H100.replace(inter_gbps=5), 32, 2**15, gpus_per_node=8, micro_batches=(1,),
                  recomputes=("selective",), model_states=("device",))
    best = plan(req, explain=False).best
    assert best.mesh_shape.zero_pp == "hpz,qwz,qgz" and best.mesh_shape.fsdp > 8, best.mesh_shape.describe()
    monkeypatch.setattr(request, "ZERO_PP_TRIED", ())
    plain = plan(req, explain=False).best
    assert best.step_s < 0.8 * plain.step_s, (best.step_s, plain.step_s)
    cfg = plan_config(best, req, load_config(None, {"model": {"preset": "llama3-70b"}}))
    assert (cfg.parallel.zero_pp, cfg.parallel.ranks_per_node) == ("hpz,qwz,qgz", 8)
    assert runnable(cfg, 32) == ""


def test_a_tie_goes_to_plain_fsdp():
    """One GPU per node would make every transfer cross nodes; with links so fast that nothing is
    exposed the step times tie and the plain plan ranks first."""
    fast = H100.replace(inter_gbps=1e6, intra_gbps=1e6)
    res = plan(Request(M, fast, 16, 2**17, gpus_per_node=8, micro_batches=(1,), recomputes=("full",),
                       offload_fractions=(0.0,), model_states=("device",)), explain=False)
    assert res.best.mesh_shape.zero_pp == ""
    assert any(e.mesh_shape.zero_pp for e in res.feasible)


@pytest.mark.parametrize("zero_pp,hpz_ranks", [("", 0), ("hpz,qwz,qgz", 0), ("hpz,qwz,qgz", 4)])
def test_a_plans_fsdp_bytes_per_rank_are_its_link_levels_share(zero_pp, hpz_ranks):
    """The per-rank FSDP figure a plan reports (what the metrics line says for that layout) is the
    world's share of its bytes per link level (bench comm's closed forms), less the loss all-reduce:
    under ZeRO++ what qwz, hpz and qgz send, not plain FSDP's bf16 and fp32 volumes."""
    from longctx.costs.link_bytes import _loss_bytes
    from longctx.memory.policy import MemoryPolicy
    from longctx.planner.cost import estimate
    from longctx.planner.slow_links import link_level_bytes

    shape = MeshShape(dp_shard=16, zero_pp=zero_pp, node=8 if zero_pp else 0, hpz_ranks=hpz_ranks)
    est = estimate(M, H100, shape, MemoryPolicy(recompute="selective"), seq_len=8192, global_batch=16)
    levels = link_level_bytes(M, shape, H100, 8)
    job = sum(levels.values()) - levels.get("intra_group_bytes", 0) - sum(_loss_bytes(16, 2, 0))
    assert 16 * est.comm_bytes["fsdp"]["fsdp"] == pytest.approx(job, rel=1e-4)
    if zero_pp:
        plain = estimate(M, H100, MeshShape(dp_shard=16), MemoryPolicy(recompute="selective"), seq_len=8192,
                         global_batch=16)
        assert est.comm_bytes["fsdp"]["fsdp"] < 0.6 * plain.comm_bytes["fsdp"]["fsdp"]
