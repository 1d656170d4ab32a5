"""The model presets: `model.preset` fills every model field the user did not set explicitly, so
`--model.preset llama3-8b --model.layers 2` is the 8B shape with two layers. `debug` (the default),
`small-100m`, `debug-moe` and `small-moe` are longctx's own shapes (the byte tokenizer's 320-token
vocabulary); each one named after a model is its published shape, as its config.json gives it
(tests/unit/test_presets_audit_published_configs.py)."""

from __future__ import annotations

from typing import Any


def _llama3(factor: float, tie: bool, **shape) -> dict[str, Any]:
    """A Llama 3.x shape: 128K-token vocabulary, rope_theta 500000, Llama-3 rope scaling."""
    return dict(shape, vocab_size=128256, rope_theta=500000.0, rope_scaling="llama3", rope_factor=factor,
                rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
                tie_embeddings=tie, max_seq_len=131072)


def _moe(shape: dict[str, Any], **moe) -> dict[str, Any]:
    """A shape with [model.moe] keys (given without their `moe.` prefix)."""
    return dict(shape, **{f"moe.{k}": v for k, v in moe.items()})


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=128, layers=4, heads=4, kv_heads=2, head_dim=0, ffn_dim=384, vocab_size=320,
                  rope_theta=10000.0, rope_scaling="none", tie_embeddings=False, max_seq_len=131072),
    # ~100M parameters with the byte tokenizer: the CPU benchmark's "real" model
    "small-100m": dict(dim=768, layers=14, heads=12, kv_heads=4, head_dim=0, ffn_dim=2304, vocab_size=320,
                       rope_theta=500000.0, rope_scaling="none", tie_embeddings=False, max_seq_len=131072),
    "llama3-1b": _llama3(32.0, True, dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn_dim=8192),
    "llama3-3b": _llama3(32.0, True, dim=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn_dim=8192),
    "llama3-8b": _llama3(8.0, False, dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn_dim=14336),
    "llama3-70b": _llama3(8.0, False, dim=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn_dim=28672),
    # Mixture-of-Experts shapes ([model.moe]); the published ones as their config.json gives them
    "debug-moe": _moe(dict(dim=128, layers=4, heads=4, kv_heads=2, head_dim=0, ffn_dim=384, vocab_size=320,
                           rope_theta=10000.0, rope_scaling="none", tie_embeddings=False, max_seq_len=131072),
                      experts=8, top_k=2, expert_dim=128, dense_layers="0", aux_loss=0.01, z_loss=0.001),
    "small-moe": _moe(dict(dim=512, layers=8, heads=8, kv_heads=4, head_dim=0, ffn_dim=1536, vocab_size=320,
                           rope_theta=500000.0, rope_scaling="none", tie_embeddings=False, max_seq_len=131072),
                      experts=16, top_k=2, expert_dim=512, shared_experts=1, shared_dim=512, dense_layers="0",
                      aux_loss=0.01, z_loss=0.001),
    "mixtral-8x7b": _moe(dict(family="mixtral", dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                              ffn_dim=14336, vocab_size=32000, rope_theta=1e6, rope_scaling="none",
                              tie_embeddings=False, max_seq_len=32768),
                         experts=8, top_k=2, expert_dim=14336, norm_topk=True, aux_loss=0.02, aux_loss_scope="pooled"),
    "qwen3-30b-a3b": _moe(dict(family="qwen3_moe", dim=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                               ffn_dim=6144, vocab_size=151936, rope_theta=1e6, rope_scaling="none", qk_norm=True,
                               norm_eps=1e-6, tie_embeddings=False, max_seq_len=40960),
                          experts=128, top_k=8, expert_dim=768, norm_topk=True, aux_loss=0.001,
                          aux_loss_scope="pooled"),
    "olmoe-1b-7b": _moe(dict(family="olmoe", dim=2048, layers=16, heads=16, kv_heads=16, head_dim=0, ffn_dim=1024,
                             vocab_size=50304, rope_theta=10000.0, rope_scaling="none", qk_norm=True,
                             qk_norm_span="all", tie_embeddings=False, max_seq_len=4096, padding_idx=1),
                        experts=64, top_k=8, expert_dim=1024, norm_topk=False, aux_loss=0.01, z_loss=0.001,
                        aux_loss_scope="pooled"),
}
