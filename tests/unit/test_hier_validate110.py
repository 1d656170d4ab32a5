"""`longctx plan --validate` and hierarchical expert dispatch (parallel.expert_ranks_per_node). Before: no fixed case
was hierarchical, and a hierarchical Case handed to run_case lost R in its config (case_config), so its ranks ran
the flat exchange and were compared with the hierarchical prediction (and passed). Now the fixed cases hold one
(debug-moe, dp4 x expert 4 as 2 nodes of 2) whose ranks run the hierarchy, record their rows on each level
(planner/validate_hier.py), and are compared at those rows: the saved bytes at the measured P and S, each rank's
bytes on the two levels at its rows. Here: the case, the reading of the records, the forms against the planner's
at uniform rows, and the verdict on ranks faked from a routing. (The run: tests/e2e/test_hier_validate110_cli.py.)"""

import random

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner import validate

HW = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")
MODEL = load_config(None, ["--model.preset=debug-moe"]).model  # 8 experts, top-2, 3 MoE layers
HIER = validate.Case("hier", "debug-moe", 256, MeshShape(dp_shard=4, expert=4, expert_ranks_per_node=2),
                     MemoryPolicy("none"), expert_skew=2.0)


def test_a_hierarchical_case_runs_the_hierarchy():
    assert validate.case_config(HIER).parallel.expert_ranks_per_node == 2  # (before: 0, the flat exchange ran)


def test_the_fixed_cases_hold_a_hierarchical_one():
    hier = [c for c in validate.BYTES_CASES if 0 < c.mesh_shape.expert_ranks_per_node < c.mesh_shape.expert]
    assert hier and validate.case_config(hier[0]).parallel.expert_ranks_per_node == 2


def test_a_hierarchical_case_with_recomputed_calls_is_refused():
    with pytest.raises(ValueError, match="stored MoE calls only"):
        validate.Case("hier full", "debug-moe", 256, HIER.mesh_shape, MemoryPolicy("full"))


def routes_of(seed: int, tokens: int = 256, layers: int = 3, experts: int = 8, k: int = 2, nodes: int = 2,
              per_node: int = 2) -> list[dict]:
    """What record_routes records on each rank of an expert group of nodes x per_node ranks for a random top-k
    routing, worked out as parallel/expert/hierarchy.py routes it (rows to each node that holds a choice, to
    the rank of the sender's local index; pairs counted per node expert)."""
    rng = random.Random(seed)
    ep, node_experts = nodes * per_node, experts // nodes
    out = [{} for _ in range(ep)]
    for layer in range(layers):
        choices = [[rng.sample(range(experts), k) for _ in range(tokens)] for _ in range(ep)]
        send = [[sum(any(e // node_experts == n for e in c) for c in choices[q]) for n in range(nodes)]
                for q in range(ep)]
        for q in range(ep):
            node, local = divmod(q, per_node)
            pairs = [0] * node_experts
            for src in (m * per_node + local for m in range(nodes)):
                for c in choices[src]:
                    for e in c:
                        if e // node_experts == node:
                            pairs[e - node * node_experts] += 1
            out[q][layer] = {"tokens": tokens, "send_rows": send[q], "pairs": pairs,
                             "recv_rows": [send[m * per_node + local][node] for m in range(nodes)]}
    return out


def test_the_records_are_read_level_by_level():
    from longctx.planner.validate_hier import measured_rows

    # one layer, worked by hand: rank 0 (node 0, local 0) routes 10 tokens (top-2), 7 rows to its own node and 5
    # to node 1, receives 4 from node 1; its node-rank's pairs per node expert [3, 2, 4, 1]: 5 for itself, 5 for
    # rank 1, whose pairs [1, 1, 2, 6] send it 2
    routes = [{0: {"tokens": 10, "send_rows": [7, 5], "recv_rows": [7, 4], "pairs": [3, 2, 4, 1]}},
              {0: {"tokens": 10, "send_rows": [6, 6], "recv_rows": [6, 5], "pairs": [1, 1, 2, 6]}},
              {0: {"tokens": 10, "send_rows": [4, 8], "recv_rows": [5, 8], "pairs": [2, 2, 2, 2]}},
              {0: {"tokens": 10, "send_rows": [5, 3], "recv_rows": [6, 3], "pairs": [0, 4, 4, 0]}}]
    rank0, rank1 = measured_rows(routes, 2, 2)[:2]
    assert rank0 == {"tokens": 10, "pairs": 10, "sent": 12, "sent_remote": 5, "received_remote": 4, "pairs_out": 5,
                     "pairs_in": 2, "expert_rows": 7, "layers": 1, "receive_skew": 7 / 20}
    assert (rank1["pairs_out"], rank1["pairs_in"], rank1["expert_rows"]) == (2, 5, 13)
    figs = measured_rows(routes_of(0), 2, 2)  # every routed choice lands once: sums agree
    total = sum(f["tokens"] for f in figs) * 2
    assert sum(f["pairs"] for f in figs) == sum(f["expert_rows"] for f in figs) == total
    assert sum(f["sent_remote"] for f in figs) == sum(f["received_remote"] for f in figs)
    assert sum(f["pairs_out"] for f in figs) == sum(f["pairs_in"] for f in figs)


def test_the_level_forms_at_uniform_rows_are_the_planners():
    from longctx.costs.hier_bytes import hier_expert_bytes
    from longctx.memory.hier_counts import remote_nodes
    from longctx.planner.validate_hier import level_bytes_at

    tokens, layers = 224, 3
    crossing = layers * tokens * remote_nodes(8, 2, 2)  # (a fig sums its layers)
    pairs = layers * tokens * 2 / 2  # T k (R - 1) / R
    uniform = {"sent_remote": crossing, "received_remote": crossing, "pairs_out": pairs, "pairs_in": pairs,
               "layers": layers}
    planner = hier_expert_bytes(tokens=tokens, m=MODEL, expert=4, ranks_per_node=2, elem=4)
    got = level_bytes_at(MODEL, uniform, 4, 2, 4)
    assert got.keys() == planner.keys()
    for dim in planner:
        assert got[dim] == pytest.approx({label: layers * v for label, v in planner[dim].items()}), dim


def test_the_saved_bytes_follow_the_measured_pairs_and_rows():
    from longctx.memory.hier_counts import expected_pairs_and_sent, hier_pair_row_bytes, hier_sent_row_bytes
    from longctx.planner.validate_hier import hier_saved_at

    layers, tokens, skew = 3, 256, 1.3
    p, s = expected_pairs_and_sent(MODEL, tokens, 4, 2, skew)
    fig = {"layers": layers, "tokens": layers * tokens, "pairs": layers * p, "sent": layers * s}
    at_rows, expected = hier_saved_at(MODEL, 4, fig, 4, 2, skew)
    assert at_rows == pytest.approx(expected)  # rows at their expectation: the planner's figure
    moved = dict(fig, pairs=fig["pairs"] + 30, sent=fig["sent"] - 7)
    at_rows, _ = hier_saved_at(MODEL, 4, moved, 4, 2, skew)
    assert at_rows - expected == pytest.approx(30 * hier_pair_row_bytes(MODEL, 4) - 7 * hier_sent_row_bytes(MODEL))


def _run_faked(monkeypatch, routes, levels_off=0, acts=None):
    """run_case on ranks faked as having routed `routes`: the planner's own comm, FSDP and state figures, the
    level bytes at their rows (one rank's `levels_off` bytes off), activations `acts` (None: as predicted)."""
    from longctx.planner.validate_hier import level_bytes_at, measured_rows

    est, predicted = validate._predict(HIER, HW, validate.case_config(HIER))
    figs = measured_rows(routes, 2, 2)
    levels = [level_bytes_at(MODEL, f, 4, 2, 4) for f in figs]
    levels[1]["expert_node"]["expert_node"] += levels_off

    def rank(r):
        return {"rank": r, "times": [1.0], "counters": predicted,
                "fsdp": {"all_gather": est.comm_bytes.get("fsdp", {}).get("fsdp", 0.0)},
                "model_states": est.memory["model_states"], "expert_counts": routes[r], "expert_levels": levels[r],
                "activations": {"device": acts if acts is not None else 0.0, "host": 0.0}}
    monkeypatch.setattr(validate, "run_spawned", lambda world, *_a, **_k: [rank(r) for r in range(world)])
    return validate.run_case(HIER, HW)


def test_ranks_are_checked_at_the_rows_they_measured(monkeypatch):
    routes = routes_of(1)
    probe = _run_faked(monkeypatch, routes)
    row = _run_faked(monkeypatch, routes, acts=probe["activations_predicted"])
    assert row["expert_levels_equal_all_ranks"] and row["activations_within_5pct"] and row["model_states_equal"]
    hottest = row["expert_hottest_rank"]
    assert row["expert_skew_measured"][hottest] == max(row["expert_skew_measured"])
    # the prediction at the measured skew, its P and S measured rather than expected
    from longctx.planner.validate_hier import hier_saved_at, measured_rows
    fig = measured_rows(routes, 2, 2)[hottest]
    at_rows, expected = hier_saved_at(MODEL, 4, fig, 4, 2, fig["receive_skew"])
    assert row["activations_predicted"] - row["activations_predicted_at_expected_rows"] == pytest.approx(
        at_rows - expected)
    monkeypatch.setattr(validate, "calibrate", lambda world: HW)
    monkeypatch.setattr(validate, "run_case", lambda case, hw, **_k: row)
    assert validate.main(cases=[HIER], ranking_cases=[]) == 0


def test_one_rank_a_byte_off_on_a_level_fails_the_case_and_the_exit_status(monkeypatch):
    routes = routes_of(2)
    probe = _run_faked(monkeypatch, routes)
    row = _run_faked(monkeypatch, routes, levels_off=1, acts=probe["activations_predicted"])
    assert row["expert_levels_equal_all_ranks"] is False and row["activations_within_5pct"]
    monkeypatch.setattr(validate, "calibrate", lambda world: HW)
    monkeypatch.setattr(validate, "run_case", lambda case, hw, **_k: row)
    assert validate.main(cases=[HIER], ranking_cases=[]) == 1
