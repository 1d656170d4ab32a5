"""memory/hier_transients.py by hand, and the plan's and the preflight's transient include it for an expert degree
split into nodes (parallel.expert_ranks_per_node); what 4 gloo ranks hold: tests/distributed/
test_hiertrans109_ranks.py. Also the length of the functions split beside it (a pure refactor: their own tests)."""

import ast
import dataclasses
from pathlib import Path

import pytest

from longctx.config import ModelConfig
from longctx.costs.host_bytes import predicted_rank_bytes
from longctx.costs.shape import MeshShape
from longctx.memory.hier_counts import hier_call_bytes
from longctx.memory.hier_transients import hier_stage_bytes, hier_transient_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import ffn_backward_bytes
from longctx.planner.activation_costs import rank_activations

# debug-moe's MoE layer (dim 128, 8 experts of 128, top-2), in a 2-block model (block 0 dense)
MOE = ModelConfig(dim=128, layers=2, heads=4, kv_heads=2, ffn_dim=384, vocab_size=320, moe_experts=8, moe_top_k=2,
                  moe_expert_dim=128, moe_dense_layers="0")
NONE, FULL = MemoryPolicy("none"), MemoryPolicy("full")


def test_stages_by_hand():
    """112 tokens on 2 nodes of 2: P = 224 pairs, S = R_x = 112 x 2 (1 - C(4,2)/C(8,2)) = 176 rows, d = 128, fp32."""
    got = hier_stage_bytes(MOE, 112, expert=4, ranks_per_node=2, e=4)
    row = 128 * 4
    assert got["forward_combine"] == pytest.approx((224 + 176 + 176 + 112) * row)
    assert got["backward_combine"] == pytest.approx(3 * 224 * row + 224 * 4)
    assert got["backward_dispatch"] == pytest.approx(max((224 + 2 * 176) * row + 224 * 4,
                                                         (176 + 176 + 2 * 112) * row + 4 * 176 * 2))


def test_a_stored_top2_call_adds_nothing_a_recomputed_one_its_forward_combine_and_saved_bytes():
    ffn = ffn_backward_bytes(MOE, 112, 4, True)
    assert ffn == 112 * (4 * 2 * 3 * 128 + 4 * 2)
    assert hier_transient_bytes(MOE, 112, 4, 2, NONE, 4) == 0.0
    forward_combine = (224 + 176 + 176 + 112) * 128 * 4
    saved = hier_call_bytes(MOE, 4, 112, 4, 2)
    assert hier_transient_bytes(MOE, 112, 4, 2, FULL, 4) == pytest.approx(forward_combine - ffn + saved)
    # selective without offload recomputes every token as full does; block chunks cut the call
    assert hier_transient_bytes(MOE, 112, 4, 2, MemoryPolicy("selective"), 4) == pytest.approx(
        forward_combine - ffn + saved)
    chunked = MemoryPolicy("full", block_chunk=56)
    assert hier_transient_bytes(MOE, 112, 4, 2, chunked, 4) == pytest.approx(
        hier_transient_bytes(MOE, 56, 4, 2, FULL, 4))


def test_top1_routing_dispatch_backward_exceeds_the_count():
    """k = 1 on 2 nodes: P = S = R_x = T; the dispatch's backward holds 4 of d per token (+ 4 B of weights' gradient
    per token), the count 3 of d (+ 4 B): one row of d more per token."""
    top1 = dataclasses.replace(MOE, moe_top_k=1)
    assert hier_transient_bytes(top1, 64, 4, 2, NONE, 4) == pytest.approx(64 * 128 * 4)


def test_flat_exchange_and_dense_models_count_nothing():
    for expert, per_node in ((4, 0), (4, 4), (1, 0)):
        assert hier_transient_bytes(MOE, 112, expert, per_node, FULL, 4) == 0.0
    dense = ModelConfig(dim=128, layers=2, heads=4, kv_heads=2, ffn_dim=384, vocab_size=320)
    assert hier_transient_bytes(dense, 112, 4, 2, FULL, 4) == 0.0


@pytest.mark.parametrize("policy", [NONE, FULL], ids=["none", "full"])
def test_the_plan_and_the_preflight_include_it(policy):
    flat, hier = MeshShape(dp_shard=4, expert=4), MeshShape(dp_shard=4, expert=4, expert_ranks_per_node=2)
    seq = 448  # 448 tokens per rank
    want = hier_transient_bytes(MOE, seq, 4, 2, policy, 4)
    assert want > 0 if policy is FULL else want == 0
    (_, t_flat), (_, t_hier) = (rank_activations(MOE, seq, 1, s, policy, 4, False) for s in (flat, hier))
    assert t_hier - t_flat == pytest.approx(want)
    kw = {"seq_len": seq, "micro_batch": 1, "grad_accum": 1, "dtype_bytes": 4, "device_type": "cpu"}
    (dev_flat, _), (dev_hier, _) = (predicted_rank_bytes(MOE, s, policy, "device", **kw) for s in (flat, hier))
    assert dev_hier["transient"] - dev_flat["transient"] == pytest.approx(want)


SPLIT = {"memory/accounting.py": "layer_activations", "memory/auto.py": "choose_offload_fraction",
         "memory/transients.py": "transient_bytes", "bench/attention_docs.py": "run_docs"}


@pytest.mark.parametrize("path", sorted(SPLIT))
def test_the_split_functions_are_at_most_60_lines(path):
    src = Path(__file__).resolve().parents[2] / "src" / "longctx" / path
    fn = next(n for n in ast.parse(src.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == SPLIT[path])
    assert fn.end_lineno - fn.lineno + 1 <= 60
