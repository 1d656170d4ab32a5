"""`longctx plan` costs FlexMoE's copies of hot experts (parallel.expert_replicas) instead of refusing them
(planner/expert_copies.py): --expert-replicas tries copy slots where expert > 1, their memory is the activation
count's with the slots (no second count), their time the load they take off the most loaded rank under
--expert-skew against their weights over the links, and --parallel.expert_replicas=N is planned and written.

debug-moe at expert 2 (8 experts, 4 a rank, top-2): skew 2 is the most routing allows there (every row on rank 0's
experts); the placer's water-filling with one slot copies one of rank 0's four equally hot experts to rank 1
(2 -> 1.5 x an even share), with two slots two of them (-> 1.0)."""

import argparse

import pytest

from longctx.config import load_config
from longctx.costs.hardware import load_hardware
from longctx.costs.shape import MeshShape
from longctx.memory.accounting import activation_dtype, layer_activations
from longctx.memory.moe_counts import copy_slot_bytes, moe_call_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cli import _plan, add_arguments, build_request
from longctx.planner.cost import estimate
from longctx.planner.expert_copies import copy_relief
from longctx.planner.request import Request
from longctx.planner.search import plan

MODEL = load_config(None, ["--model.preset=debug-moe"]).model
HW = load_hardware("h100", [], world=2)
SEQ = 4096


def _request(skew: float, replicas=(0, 1), **kw) -> Request:
    return Request(MODEL, HW, 2, SEQ, global_batch=2, micro_batches=(1,), recomputes=("none",), loss_chunks=(0,),
                   expert_degrees=(2,), expert_skew=skew, expert_chunks=(0,), model_states=("device",),
                   expert_replicas=replicas, **kw)


NONE = MemoryPolicy("none")


def _estimate(replicas: int, skew: float, policy=NONE):
    return estimate(MODEL, HW, MeshShape(dp_shard=2, expert=2, expert_replicas=replicas), policy, seq_len=SEQ,
                    global_batch=2, micro_batch=1, gpus_per_node=8, expert_skew=skew)


def test_the_placers_relief_is_its_own_water_filling():
    assert copy_relief(8, 2, 1, 2.0).skew == pytest.approx(1.5) and copy_relief(8, 2, 1, 2.0).copies == 1
    assert copy_relief(8, 2, 2, 2.0).skew == pytest.approx(1.0) and copy_relief(8, 2, 2, 2.0).copies == 2
    assert copy_relief(8, 2, 2, 1.0).skew == 1.0 and copy_relief(8, 2, 2, 1.0).copies == 0


def test_under_skew_2_copies_win_by_fewer_rows_on_the_hot_rank_against_more_bytes():
    res = plan(_request(2.0))
    best = res.best
    assert best.mesh_shape.expert_replicas == 1
    assert {e.mesh_shape.expert_replicas for e in res.feasible} == {0, 1}
    without, with_copies = _estimate(0, 2.0), _estimate(1, 2.0)
    # the bytes: one copy (3 x 128 x expert_dim bf16 values) there and back, per MoE layer, each micro-batch
    one = 3 * MODEL.dim * MODEL.resolved_expert_dim * HW.dtype_bytes
    assert with_copies.comm_bytes["expert"]["expert_copies"] == 2 * len(MODEL.moe_layer_ids) * one
    assert "expert_copies" not in without.comm_bytes["expert"]
    assert with_copies.times["exposed_expert_copies"] > 0
    # the rows: the hot rank timed at 1.5 x its share, not 2 (the all-to-all and the straggler's GEMMs)
    assert with_copies.times["exposed_expert"] < without.times["exposed_expert"]
    assert with_copies.step_s < without.step_s
    assert with_copies.memory["activations"] > without.memory["activations"]


def test_copies_memory_is_the_activation_count_with_the_slots_once():
    est0, est1 = _estimate(0, 2.0), _estimate(1, 2.0)
    e, autocast = activation_dtype(HW.dtype_bytes == 2, 2, "device")
    kw = dict(head=1, ctx=1, policy=MemoryPolicy("none"), dtype_bytes=e, docs=True, expert=2, expert_skew=2.0,
              autocast=autocast)
    counted = {r: sum(la.device for la in layer_activations(MODEL, SEQ, 1, expert_replicas=r, **kw)) for r in (0, 1)}
    assert est1.memory["activations"] - est0.memory["activations"] == pytest.approx(counted[1] - counted[0], abs=1)
    # (each MoE block's stored call: its copy slot's weights, the rows' slot order, the fetch's indices, and its
    # grouped GEMMs' offsets over one group more)
    rows, c = SEQ * MODEL.moe_top_k, 2 if autocast else None
    offsets = moe_call_bytes(MODEL, e, True, False, c, groups=5) - moe_call_bytes(MODEL, e, True, False, c, groups=4)
    slots = len(MODEL.moe_layer_ids) * (copy_slot_bytes(MODEL, e, 2, 1, rows, False, c) + offsets)
    assert counted[1] - counted[0] == pytest.approx(slots, abs=1)
    assert est1.memory["transient"] == est0.memory["transient"]


def test_under_even_routing_copies_are_never_better():
    res = plan(_request(1.0, replicas=(0, 1, 2)))
    assert res.best.mesh_shape.expert_replicas == 0
    for policy in (MemoryPolicy("none"), MemoryPolicy("full")):
        base = _estimate(0, 1.0, policy)
        for r in (1, 2):
            copies = _estimate(r, 1.0, policy)
            assert copies.step_s >= base.step_s
            # (more held where the calls keep their saved tensors; recomputed calls keep no copy)
            assert copies.memory["total"] >= base.memory["total"]
            assert copies.memory["total"] > base.memory["total"] or policy.recompute == "full"
    ranked = list(res.ranked[:len(res.feasible)])
    for i, e in enumerate(ranked):  # a copies plan never comes before its layout without copies
        if e.mesh_shape.expert_replicas:
            twin = [j for j, o in enumerate(ranked) if not o.mesh_shape.expert_replicas and o.policy == e.policy
                    and o.mesh_shape.dp_shard == e.mesh_shape.dp_shard and o.mesh_shape.ctx == e.mesh_shape.ctx
                    and o.mesh_shape.dp_replicate == e.mesh_shape.dp_replicate and o.micro_batch == e.micro_batch]
            assert twin and min(twin) < i


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


ARGS = ["--model", "debug-moe", "--gpus", "2", "--seq-len", "4K", "--hardware", "h100", "--recompute", "none",
        "--micro-batch", "1", "--expert-skew", "2"]


@pytest.mark.parametrize("form", [["--parallel.expert_replicas=1"], ["--parallel.expert_replicas", "1"]])
def test_an_expert_replicas_override_is_planned_and_written(tmp_path, form):
    req, base = build_request(_args(ARGS), form)
    assert req.expert_replicas == (1,) and base.parallel.expert_replicas == 0
    out = tmp_path / "plan.toml"
    assert _plan(_args([*ARGS, "--out", str(out)]), form) == 0
    cfg = load_config(str(out), [])
    assert cfg.parallel.expert_replicas == 1 and cfg.parallel.expert == 2


def test_the_flag_tries_copies_and_the_hierarchical_dispatch_needs_whole_nodes(tmp_path):
    flags = [*ARGS, "--expert", "2", "--expert-replicas", "0,1,2"]
    req, _ = build_request(_args(flags), [])
    assert req.expert_replicas == (0, 1, 2)
    out = tmp_path / "plan.toml"
    assert _plan(_args([*flags, "--out", str(out)]), []) == 0
    assert load_config(str(out), []).parallel.expert_replicas == 2  # (2 -> 1.0 x the share: the rows even)
    with pytest.raises(Exception, match="give one of them"):
        build_request(_args([*ARGS, "--expert-replicas", "0,1"]), ["--parallel.expert_replicas=1"])
    # (the hierarchical dispatch is costed since session 109: on 2 GPUs no expert group splits into nodes of 2)
    with pytest.raises(Exception, match="expert_ranks_per_node = 2 .*tries no such expert degree"):
        build_request(_args(ARGS), ["--parallel.expert_ranks_per_node=2"])


def test_copies_need_an_expert_degree_above_1():
    with pytest.raises(Exception, match="no expert degree > 1"):
        Request(MODEL, HW, 2, SEQ, expert_degrees=(1,), expert_replicas=(0, 1))
    with pytest.raises(Exception, match="at most one copy of each expert it does not own, 4"):
        Request(MODEL, HW, 2, SEQ, expert_degrees=(2,), expert_replicas=(5,))


def test_validate_reads_each_ranks_received_rows_through_the_filled_slots():
    from longctx.planner.validate import BYTES_CASES
    from longctx.planner.validate_experts import every_slot_filled, received_skews

    assert any(c.mesh_shape.expert_replicas and c.expert_skew == 2.0 for c in BYTES_CASES)
    placement = every_slot_filled(8, 2, 1)  # rank 0's slot copies expert 4 (rank 1's), rank 1's expert 0
    assert placement.slot_expert == ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))
    # every row of both ranks on expert 0: rank 0 receives half of them, its copy holder rank 1 the other half
    counts = [{0: [10, 0, 0, 0, 0, 0, 0, 0]}, {0: [10, 0, 0, 0, 0, 0, 0, 0]}]
    assert received_skews(counts, 8, 2, 1) == [1.0, 1.0]
    assert received_skews(counts, 8, 2, 0) == [2.0, 0.0]  # (the static placement: all on the owner)
