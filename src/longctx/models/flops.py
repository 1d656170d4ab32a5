"""Model math: matmul parameters and model FLOPs per token (what the math needs, not what
recomputation adds), read by the training metrics (MFU) and the planner alike.

Per layer and token, forward: 2 x (matmul parameters the token goes through) + 4 x seq x d_attn,
the attention score term halved under a causal mask (counted so also with document masks, which
skip more: MFU is then an upper bound, as in most reports); the LM head adds 2 x dim x vocab;
training is 3x forward.

Mixture of Experts (models/moe.py): a MoE layer's feed-forward holds every expert (`moe_ffn_params`
with active=False: what memory and FSDP count), but a token goes through its router gate (dim x
experts), its top_k routed experts and the shared experts (active=True: what FLOPs count). Layers
in model.moe.dense_layers keep the dense SwiGLU of ffn_dim. Dropped tokens (moe.capacity_factor)
are counted as routed, and the DTS router as after its annealing (top_k experts): model FLOPs, not
the work a step happened to do.
"""

from __future__ import annotations

from ..config import ModelConfig


def attention_matmul_params(cfg: ModelConfig) -> int:
    """q, k, v and output projections of one layer."""
    hd = cfg.resolved_head_dim
    return cfg.dim * (cfg.heads + 2 * cfg.kv_heads) * hd + cfg.heads * hd * cfg.dim


def dense_ffn_params(cfg: ModelConfig) -> int:
    """The SwiGLU of ffn_dim (w1, w3, w2)."""
    return 3 * cfg.dim * cfg.ffn_dim


def moe_ffn_params(cfg: ModelConfig, active: bool) -> int:
    """One MoE feed-forward's matmul parameters: the router gate (dim x experts), the routed experts
    (each a SwiGLU of expert_dim: all of them, or the top_k a token goes through when `active`), the
    shared experts (a SwiGLU of shared_dim) and their sigmoid gate (dim x 1)."""
    d = cfg.dim
    routed = (cfg.moe_top_k if active else cfg.moe_experts) * 3 * d * cfg.resolved_expert_dim
    return (d * cfg.moe_experts + routed + 3 * d * cfg.resolved_shared_dim
            + (d if cfg.moe_shared_gate else 0))


def matmul_params_per_layer(cfg: ModelConfig, moe: bool = False, active: bool = False) -> int:
    """Matmul parameters of one layer: attention and its feed-forward, a MoE one (`moe`, only for a
    MoE model) with all experts, or with those a token goes through (`active`)."""
    ffn = moe_ffn_params(cfg, active) if moe and cfg.is_moe else dense_ffn_params(cfg)
    return attention_matmul_params(cfg) + ffn


def layer_matmul_params(cfg: ModelConfig, active: bool = False) -> list[int]:
    """matmul_params_per_layer of every layer, in order (MoE layers are cfg.moe_layer_ids)."""
    sparse = set(cfg.moe_layer_ids)
    dense, moe = matmul_params_per_layer(cfg, False, active), matmul_params_per_layer(cfg, True, active)
    return [moe if i in sparse else dense for i in range(cfg.layers)]


def forward_matmul_flops_per_token(cfg: ModelConfig) -> float:
    """2 FLOPs per matmul parameter a token goes through, in every block and the LM head."""
    return 2 * sum(layer_matmul_params(cfg, active=True)) + 2 * cfg.dim * cfg.vocab_size


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one forward pass, per token of a sequence of length seq_len."""
    d_attn = cfg.heads * cfg.resolved_head_dim
    attn_scores = 4 * seq_len * d_attn * (0.5 if causal else 1.0)
    return forward_matmul_flops_per_token(cfg) + cfg.layers * attn_scores


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len, causal)
