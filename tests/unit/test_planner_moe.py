"""Planner and model math for Mixture-of-Experts models: parameters and model states count every
expert, FLOPs the experts a token goes through; a MoE model is planned.

TINY_MOE (worked by hand below): dim 8, 2 query heads and 1 kv head of 4 dims, vocabulary 10, two
layers: layer 0 dense (SwiGLU of 16, moe.dense_layers "0"), layer 1 a MoE feed-forward of 4
experts of 6, top-2, shared experts of 10 behind a sigmoid gate.
  attention matmuls   8 x (2 + 2) x 4 + 2 x 4 x 8                    = 192
  dense SwiGLU        3 x 8 x 16                                       = 384
  MoE, all experts    gate 8 x 4 + 4 x 3 x 8 x 6 + 3 x 8 x 10 + 8     = 32 + 576 + 240 + 8 = 856
  MoE, per token      gate 32 + 2 x 3 x 8 x 6 + shared 240 + gate 8    = 32 + 288 + 240 + 8 = 568
  blocks (+ 2 norms of 8): dense 592, MoE 1064; root: embeddings 80 + final norm 8 + LM head 80 = 168
"""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.model_states import (
    block_params,
    gathered_param_bytes,
    param_counts,
    params_text,
    predicted_active_params,
    predicted_model_state_bytes,
)
from longctx.costs.shape import MeshShape
from longctx.costs.timing import forward_gemm_flops
from longctx.memory.policy import MemoryPolicy
from longctx.models.flops import (
    forward_flops_per_token,
    layer_matmul_params,
    moe_ffn_params,
    train_flops_per_token,
)
from longctx.planner.cost import estimate
from longctx.planner.search import Request, plan


def model(preset, **over):
    return load_config(None, {"model": {"preset": preset, **over}}).model


TINY_MOE = model("debug", dim=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn_dim=16, vocab_size=10,
                 tie_embeddings=False, **{"moe.experts": 4, "moe.top_k": 2, "moe.expert_dim": 6,
                                          "moe.shared_dim": 10, "moe.shared_gate": True, "moe.dense_layers": "0"})


def test_parameters_count_every_expert_flops_the_active_ones():
    assert moe_ffn_params(TINY_MOE, active=False) == 856 and moe_ffn_params(TINY_MOE, active=True) == 568
    assert layer_matmul_params(TINY_MOE) == [192 + 384, 192 + 856]
    assert layer_matmul_params(TINY_MOE, active=True) == [192 + 384, 192 + 568]
    assert block_params(TINY_MOE) == [592, 1064]
    assert param_counts(TINY_MOE) == {"block": 1064, "root": 168, "total": 592 + 1064 + 168, "experts": 3 * 4 * 8 * 6}
    # expert 2: a rank gathers 2 of the MoE block's 4 experts (576 routed weights, 288 of them)
    assert param_counts(TINY_MOE, expert=2)["block"] == 1064 - 288
    assert predicted_active_params(TINY_MOE) == 1824 - (856 - 568)  # the two experts a token is not sent to
    # forward per token: 2 per matmul parameter a token goes through (blocks and LM head 2 x 8 x 10),
    # and the attention scores 4 s x 8 per layer, halved by the causal mask
    for s in (1, 100):
        assert forward_flops_per_token(TINY_MOE, s) == 2 * (576 + 760) + 160 + 2 * 16 * s
        assert train_flops_per_token(TINY_MOE, s) == 3 * forward_flops_per_token(TINY_MOE, s)
    assert forward_gemm_flops(TINY_MOE, 1000) == 1000 * (2 * (576 + 760) + 160)


def test_model_states_count_every_expert():
    """16 bytes (fp32 parameter, gradient, two Adam moments) per parameter over the FSDP group; FSDP
    holds the largest block (the MoE one, all experts) gathered twice (this one and the prefetched
    next) in the gather dtype and once as an fp32 gradient, and the root."""
    shape = MeshShape(1, 2, 1, 1)
    # the shared experts' [1, 8] gate: one row over 2 ranks would keep a padded row on each (2x its even share),
    # so FSDP shards its dim 1 (costs/model_states.py shard_dim): every tensor splits evenly
    assert predicted_model_state_bytes(TINY_MOE, shape) == 16 * 1824 / 2
    assert gathered_param_bytes(TINY_MOE, shape, 2) == 2 * 1064 * 2 + 1064 * 4 + 168 * (2 + 4)


@pytest.mark.parametrize("preset", ["debug-moe", "small-moe", "mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b"])
def test_param_counts_match_the_moe_model(preset):
    from longctx.models.llama import build_model

    m = model(preset)
    meta = build_model(m, "meta")
    per_block = [sum(p.numel() for p in layer.parameters()) for layer in meta.layers]
    assert block_params(m) == per_block
    pc = param_counts(m)
    assert pc["total"] == sum(p.numel() for p in meta.parameters())
    assert pc["block"] == max(per_block)


@pytest.mark.parametrize("preset, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9),
                                                    ("qwen3-30b-a3b", 30.5e9, 3.35e9),
                                                    ("olmoe-1b-7b", 6.92e9, 1.28e9)])
def test_published_total_and_active_parameters(preset, total, active):
    """The model cards' figures: Mixtral 8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B (3.3B), OLMoE
    1B-7B 6.9B (1.3B); active = the matmuls a token goes through + embeddings, final norm, LM head."""
    m = model(preset)
    pc = param_counts(m)
    assert pc["total"] == pytest.approx(total, rel=2e-3)
    assert sum(layer_matmul_params(m, active=True)) + pc["root"] == pytest.approx(active, rel=5e-3)
    assert predicted_active_params(m) == pytest.approx(active, rel=5e-3)
    assert params_text(m) == f"{total / 1e9:.3g}B parameters, {active / 1e9:.3g}B active"


def test_estimate_counts_all_experts_for_memory_and_active_ones_for_compute():
    m = model("qwen3-30b-a3b")
    shape, seq = MeshShape(1, 1, 1, 8), 262144
    est = estimate(m, PRESETS["h100"], shape, MemoryPolicy("full", loss_chunk=4096), seq_len=seq, global_batch=8)
    assert est.memory["model_states"] == 16 * param_counts(m)["total"] / 8
    assert est.memory["model_states"] / 2**30 == pytest.approx(56.9, abs=0.05)
    # compute: the FLOPs of the experts a token goes through (8 of 128)
    tokens = seq // 8
    assert est.tokens_per_s * train_flops_per_token(m, seq) / (8 * PRESETS["h100"].peak_flops) == \
        pytest.approx(est.mfu)
    gemm = forward_gemm_flops(m, tokens)
    assert gemm == tokens * (2 * sum(layer_matmul_params(m, active=True)) + 2 * m.dim * m.vocab_size)
    assert gemm < tokens * 2 * 5e9  # ~3.35B parameters a token goes through, not 30.5B


def test_qwen3_moe_at_256k_on_8_h100_is_planned():
    """`longctx plan --model qwen3-30b-a3b --seq-len 256K --gpus 8`: a feasible plan, whose model
    states are all 30.5B parameters' over the 8 ranks."""
    m = model("qwen3-30b-a3b")
    res = plan(Request(m, PRESETS["h100"], 8, 262144))
    best = res.best
    assert best is not None and best.feasible
    assert best.memory["model_states"] == 16 * param_counts(m)["total"] / best.mesh_shape.fsdp
    assert best.memory["total"] <= PRESETS["h100"].usable_memory_bytes
    assert 0 < best.mfu < 1


# ----------------------------------------------------------------------------------------------
# expert parallelism in the planner


def test_expert_parallel_model_states_shard_the_routed_experts_over_every_rank():
    """At rest the routed experts are 1 / world per rank (E / expert each, FSDP over world / expert):
    the same as FSDP over every rank, less than replicas of them."""
    from longctx.costs.model_states import accumulated_grad_bytes, gathered_param_bytes, predicted_model_state_bytes

    pc = param_counts(TINY_MOE)
    dense, experts = pc["total"] - pc["experts"], pc["experts"]
    # FSDP2's padded shards over 4 ranks: vocabulary 10 -> 3 rows of 8 in the embeddings and the head (+2 x 4),
    # the shared experts' [10, 8] w1 and w3 3 rows each (+2 x 4): 12 / 10 rows is within shard_dim's 1.25x, so
    # dim 0 stays; the shared gate's [1, 8] (4x) is sharded on dim 1, evenly
    assert predicted_model_state_bytes(TINY_MOE, MeshShape(dp_shard=4, expert=4)) == predicted_model_state_bytes(
        TINY_MOE, MeshShape(dp_shard=4)) == 16 * (pc["total"] / 4 + 16)
    assert predicted_model_state_bytes(TINY_MOE, MeshShape(dp_replicate=4, expert=4)) == 16 * dense + 16 * experts / 4
    hsdp = MeshShape(dp_replicate=2, dp_shard=2, expert=2)
    assert predicted_model_state_bytes(TINY_MOE, hsdp) == 16 * dense / 2 + 16 * experts / 4
    # the working set: a MoE block gathered with its group's experts only; the unsharded gradients too
    assert gathered_param_bytes(TINY_MOE, MeshShape(dp_shard=4, expert=4), 2) == (
        2 * (1064 - 432) * 2 + (1064 - 432) * 4 + 168 * 6)
    assert accumulated_grad_bytes(TINY_MOE, MeshShape(dp_shard=4, expert=4), 4, "step") == 4 * (dense + experts // 4)


def test_expert_all_to_all_bytes_follow_tokens_top_k_and_recomputation():
    from longctx.memory.moe_counts import moe_forward_runs
    from longctx.memory.policy import MemoryPolicy
    from longctx.parallel.context.volumes import expert_bytes

    one = expert_bytes(tokens=100, top_k=2, experts=4, dim=8, expert=4, elem=2)
    # 200 rows, 3/4 of them leave the rank, 16 B each: dispatch + combine, forward and backward
    assert one == {"expert": 4 * 150 * 16, "expert_counts": 4 * 8 * 3 / 4}
    again = expert_bytes(tokens=100, top_k=2, experts=4, dim=8, expert=4, elem=2, forwards=2)
    assert again["expert"] == 6 * 150 * 16 and again["expert_counts"] == 2 * one["expert_counts"]
    assert expert_bytes(tokens=100, top_k=2, experts=4, dim=8, expert=1, elem=2) == {}
    # which forwards re-run: none keeps every MoE call, full and selective recompute them
    assert moe_forward_runs(TINY_MOE, 64, MemoryPolicy()) == 1
    assert moe_forward_runs(TINY_MOE, 64, MemoryPolicy("full")) == 2
    assert moe_forward_runs(TINY_MOE, 64, MemoryPolicy("selective")) == 2


def test_skew_is_bounded_by_what_routing_allows():
    from longctx.memory.moe_counts import expert_rows, max_expert_skew

    # 4 experts over 2 ranks, top 2: a rank holds 2 experts; the most a token sends it is 2 rows
    assert max_expert_skew(TINY_MOE, 2) == 2 * 2 / 2
    assert expert_rows(100, TINY_MOE, 2, 1.0) == 200 and expert_rows(100, TINY_MOE, 2, 1.5) == 300
    assert expert_rows(100, TINY_MOE, 2, float("inf")) == 400  # every token of both ranks, twice
    assert max_expert_skew(TINY_MOE, 4) == 4 * 1 / 2  # one expert per rank: one row per token at most


def test_the_plan_searches_expert_degrees_and_prices_their_skew():
    """debug-moe on 4 GPUs: plans at expert 1 and 4 are both evaluated; an expert-4 plan's
    all-to-all bytes and time appear, and grow with the planned skew, as does its memory."""
    from longctx.costs.hardware import PRESETS
    from longctx.planner.search import Request, plan

    m = model("debug-moe")
    res = {skew: plan(Request(m, PRESETS["h100"], 4, 4096, gpus_per_node=4, expert_skew=skew))
           for skew in (1.0, 4.0)}
    ranked = res[1.0].ranked
    assert {e.mesh_shape.expert for e in ranked} == {1, 4}
    ep = [e for e in ranked if e.mesh_shape.expert == 4][0]
    assert ep.comm_bytes["expert"]["expert"] > 0 and ep.times["exposed_expert"] > 0
    same = [e for e in res[4.0].ranked if e.mesh_shape == ep.mesh_shape and e.policy == ep.policy
            and e.micro_batch == ep.micro_batch][0]
    assert same.times["exposed_expert"] > ep.times["exposed_expert"]
    assert same.memory["activations"] + same.memory["transient"] > ep.memory["activations"] + ep.memory["transient"]
    assert all(e.mesh_shape.expert == 1 for e in plan(Request(model("debug"), PRESETS["h100"], 4, 4096)).ranked)
