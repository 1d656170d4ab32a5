"""Each preset named after a public model is that model, field by field, as its Hugging Face config.json
gives it: the planner, MFU, memory figures and the comparisons with published results rest on these shapes.

The config.json values below are the Hub's (meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B,
Llama-3.1-70B, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924), read through the
same reader as `model.init_from = hf:DIR` (config/hf.py), so every field it derives is compared: shapes,
norm eps, RoPE (base, llama3 bands), tied embeddings, window, q/k norms, experts, top-k, renormalisation.
Parameter counts against the model cards: tests/unit/test_model.py (Llama), test_planner_moe.py (MoE)."""

import dataclasses

import pytest

from longctx.config.hf import model_fields_from_hf
from longctx.config.load import build_model_config


def _llama3(factor: float, **shape) -> dict:
    return dict(shape, model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False,
                initializer_range=0.02, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                vocab_size=128256, rope_scaling=dict(rope_type="llama3", factor=factor, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192))


# output_router_logits=true: a preset trains with the config.json's router_aux_loss_coef (pooled, as
# transformers does when the loss is on); the Hub files ship it off, which reads as model.moe.aux_loss 0
PUBLISHED = {
    "llama3-1b": _llama3(32.0, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama3-3b": _llama3(32.0, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama3-8b": _llama3(8.0, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "llama3-70b": _llama3(8.0, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_act="silu", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                         initializer_range=0.02, tie_word_embeddings=False, num_local_experts=8,
                         num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_act="silu", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                          rope_scaling=None, attention_bias=False, use_sliding_window=False, sliding_window=None,
                          initializer_range=0.02, tie_word_embeddings=False, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                          output_router_logits=True),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_act="silu", hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                        attention_bias=False, clip_qkv=None, initializer_range=0.02, tie_word_embeddings=False,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01,
                        output_router_logits=True),
}
# what config.json cannot say: OLMoE's router z-loss (0.001 in its paper) is in no Hub key transformers reads
NOT_IN_CONFIG_JSON = {"moe.z_loss"}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_is_the_published_config_json(preset):
    want = model_fields_from_hf(PUBLISHED[preset])
    cfg = build_model_config({"preset": preset})
    have = {f.metadata.get("key", f.name): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    have["head_dim"] = cfg.resolved_head_dim  # (0 in a preset means dim // heads)
    wrong = {k: (have[k], v) for k, v in want.items() if k not in NOT_IN_CONFIG_JSON and have[k] != v}
    assert not wrong, f"{preset}: (preset, config.json) differ in {wrong}"
