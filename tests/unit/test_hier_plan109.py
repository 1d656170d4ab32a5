"""The planner costs hierarchical expert dispatch (parallel.expert_ranks_per_node) instead of refusing it: the
expected remote nodes against enumeration, its saved bytes in the activation count, its two link levels in the
plan's bytes and time (a slow inter-node link makes it win, with fewer bytes across nodes than the flat exchange),
the override taken, tried beside the flat exchange, written, and refused where it cannot run; and plans without it
unchanged. (Against what ranks send and keep: tests/distributed/test_hier_plan109_ranks.py.)"""

import argparse
from itertools import combinations

import pytest

from longctx.config import load_config
from longctx.costs.hardware import load_hardware
from longctx.costs.shape import MeshShape
from longctx.errors import ConfigError
from longctx.memory.accounting import estimate_activations
from longctx.memory.hier_counts import hier_call_bytes, nodes_reached, remote_nodes
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cli import _plan, add_arguments, build_request
from longctx.planner.cost import estimate
from longctx.planner.request import Request, candidate_shapes
from longctx.planner.search import plan

MODEL = load_config(None, ["--model.preset=debug-moe"]).model  # 8 experts, top-2, 3 MoE layers of 4
HW = load_hardware("h100", [], world=8)  # inter-node 50 GB/s, intra-node 450
NONE = MemoryPolicy("none")
SEQ = 8192


@pytest.mark.parametrize("experts, k, nodes", [(8, 2, 2), (16, 2, 2), (16, 4, 4), (12, 3, 3)])
def test_remote_nodes_is_the_enumerated_expectation(experts, k, nodes):
    per_node = experts // nodes
    subsets = list(combinations(range(experts), k))
    reached = sum(len({e // per_node for e in s}) for s in subsets) / len(subsets)
    assert nodes_reached(experts, k, nodes) == pytest.approx(reached)
    # from node 0: the other nodes a token's choices touch
    assert remote_nodes(experts, k, nodes) == pytest.approx(
        sum(len({e // per_node for e in s} - {0}) for s in subsets) / len(subsets))
    if (experts, k, nodes) == (16, 2, 2):  # hierarchy.py's docstring: 0.77 of the flat exchange's rows
        assert remote_nodes(experts, k, nodes) == pytest.approx(1 - (8 / 16) * (7 / 15))


def test_the_activation_count_adds_the_node_exchanges_saved_tensors():
    tokens = SEQ // 2
    flat = estimate_activations(MODEL, SEQ, 1, ctx=2, policy=NONE, expert=8, expert_skew=1.0)
    hier = estimate_activations(MODEL, SEQ, 1, ctx=2, policy=NONE, expert=8, expert_skew=1.0,
                                expert_ranks_per_node=4)
    per_call = hier_call_bytes(MODEL, 4, tokens, 8, 4)
    assert hier.total_device - flat.total_device == pytest.approx(3 * per_call)  # one stored call per MoE layer
    # R >= the group (or 0): the flat exchange, counted as such
    same = estimate_activations(MODEL, SEQ, 1, ctx=2, policy=NONE, expert=8, expert_ranks_per_node=8)
    assert same.total_device == flat.total_device
    # full recomputation keeps no call's tensors: nothing added
    full = MemoryPolicy("full")
    assert (estimate_activations(MODEL, SEQ, 1, ctx=2, policy=full, expert=8, expert_ranks_per_node=4).total_device
            == estimate_activations(MODEL, SEQ, 1, ctx=2, policy=full, expert=8).total_device)


def _pair(**kw):
    shapes = {r: MeshShape(dp_shard=4, ctx=2, expert=8, expert_ranks_per_node=r) for r in (0, 4)}
    return {r: estimate(MODEL, HW, s, NONE, seq_len=SEQ, global_batch=4, gpus_per_node=4, expert_skew=1.0, **kw)
            for r, s in shapes.items()}


def test_on_a_slow_inter_node_link_the_hierarchy_moves_fewer_bytes_across_nodes_and_is_faster():
    est = _pair()
    flat, hier = est[0].comm_bytes, est[4].comm_bytes
    assert "expert" in flat and "expert_node" not in flat
    assert "expert" not in hier and {"expert_node", "expert_local"} <= set(hier)
    # the flat exchange's rows: 4 of a rank's 7 peers on the other node of 4 GPUs
    flat_across = flat["expert"]["expert"] * 4 / 7
    hier_across = hier["expert_node"]["expert_node"]
    print(f"rows' bytes across nodes per rank per step: flat {flat_across:,.0f}, hierarchical {hier_across:,.0f}")
    assert hier_across < 0.9 * flat_across
    assert est[4].times["step"] < est[0].times["step"]
    # each level over its own link (skew 1: no straggler): the node's ranks on NVLink, across nodes the slow link
    eff = HW.all_to_all_efficiency
    want = (sum(hier["expert_local"].values()) / (HW.intra_gbps * 1e9)
            + sum(hier["expert_node"].values()) / (HW.inter_gbps * 1e9)) / eff
    assert est[4].times["exposed_expert"] == pytest.approx(want)
    # (everything else alike: attention and FSDP bytes)
    assert {d: v for d, v in flat.items() if d != "expert"} == {d: v for d, v in hier.items() if "expert" not in d}


def test_the_search_tries_both_and_prefers_the_hierarchy_on_a_slow_link():
    kw = dict(gpus_per_node=4, expert_degrees=(8,), recomputes=("none",), micro_batches=(1,), expert_skew=1.0)
    req = Request(MODEL, HW, 8, SEQ, expert_ranks_per_node=4, **kw)
    shapes = candidate_shapes(req)
    assert {s.expert_ranks_per_node for s in shapes} == {0, 4}
    without = candidate_shapes(Request(MODEL, HW, 8, SEQ, **kw))
    assert without == [s for s in shapes if not s.expert_ranks_per_node]  # plans without R: unchanged
    best = plan(req).best
    assert best.mesh_shape.expert_ranks_per_node == 4, best.mesh_shape.describe()


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


ARGS = ["--model", "debug-moe", "--gpus", "8", "--gpus-per-node", "4", "--seq-len", "8K", "--hardware", "h100",
        "--recompute", "none", "--micro-batch", "1", "--expert", "8"]


@pytest.mark.parametrize("form", [["--parallel.expert_ranks_per_node=4"], ["--parallel.expert_ranks_per_node", "4"]])
def test_the_override_is_planned_and_written(tmp_path, form):
    req, base = build_request(_args(ARGS), form)
    assert req.expert_ranks_per_node == 4 and base.parallel.expert_ranks_per_node == 0
    out = tmp_path / "plan.toml"
    assert _plan(_args([*ARGS, "--out", str(out)]), form) == 0
    cfg = load_config(str(out), [])
    assert cfg.parallel.expert_ranks_per_node == 4 and cfg.parallel.expert == 8


@pytest.mark.parametrize("argv, override, message", [
    (ARGS, "--parallel.expert_ranks_per_node=3", "divisor of the GPUs per node"),
    ([*ARGS[:-1], "2"], "--parallel.expert_ranks_per_node=2", "tries no such expert degree"),
    ([*ARGS[:-1], "8", "--expert-replicas", "1"], "--parallel.expert_ranks_per_node=4", None),
])
def test_an_override_that_cannot_run_is_refused(argv, override, message):
    if message is None:  # copies with a hierarchy: tried flat only (config/rules.py refuses the pair)
        req, _ = build_request(_args(argv), [override])
        assert not any(s.expert_ranks_per_node and s.expert_replicas for s in candidate_shapes(req))
        return
    with pytest.raises(ConfigError, match=message):
        build_request(_args(argv), [override])
