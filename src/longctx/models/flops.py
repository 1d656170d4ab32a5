"""Model math: matmul parameters and model FLOPs per token (what the math needs, not what
recomputation adds), read by the training metrics (MFU) and the planner alike.

Per layer and token, forward: 2 x (matmul parameters) + 4 x seq x d_attn, the attention score term
halved under a causal mask (counted so also with document masks, which skip more: MFU is then an
upper bound, as in most reports); the LM head adds 2 x dim x vocab; training is 3x forward.
"""

from __future__ import annotations

from ..config import ModelConfig


def matmul_params_per_layer(cfg: ModelConfig) -> int:
    hd = cfg.resolved_head_dim
    attn = cfg.dim * (cfg.heads + 2 * cfg.kv_heads) * hd + cfg.heads * hd * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return attn + mlp


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one forward pass, per token of a sequence of length seq_len."""
    d_attn = cfg.heads * cfg.resolved_head_dim
    attn_scores = 4 * seq_len * d_attn * (0.5 if causal else 1.0)
    per_layer = 2 * matmul_params_per_layer(cfg) + attn_scores
    return cfg.layers * per_layer + 2 * cfg.dim * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len, causal)
