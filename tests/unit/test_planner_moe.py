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
from longctx.memory.policy import MemoryPolicy
from longctx.models.flops import (
    forward_flops_per_token,
    layer_matmul_params,
    moe_ffn_params,
    train_flops_per_token,
)
from longctx.planner.cost import estimate
from longctx.planner.hardware import PRESETS
from longctx.planner.model_states import (
    active_params,
    block_params,
    gathered_param_bytes,
    model_state_bytes,
    param_counts,
    params_text,
)
from longctx.planner.search import Request, plan
from longctx.planner.shape import MeshShape
from longctx.planner.timing import forward_gemm_flops


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
    assert param_counts(TINY_MOE) == {"block": 1064, "root": 168, "total": 592 + 1064 + 168}
    assert active_params(TINY_MOE) == 1824 - (856 - 568)  # the two experts a token is not sent to
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
    assert model_state_bytes(TINY_MOE, shape) == 16 * 1824 / 2
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
    assert active_params(m) == pytest.approx(active, rel=5e-3)
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
