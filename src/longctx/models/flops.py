"""Model math: matmul parameters and model FLOPs per token (what the math needs, not what
recomputation adds), read by the training metrics (MFU) and the planner alike.

Per layer and token, forward: 2 x (matmul parameters the token goes through) + 4 x seq x d_attn,
the attention score term halved under a causal mask (counted so also with document masks, which
skip more: MFU is then an upper bound, as in most reports); the LM head adds 2 x dim x vocab (counted
for every token, also where a step runs it over the scored rows only: ops/loss.py scored_rows);
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


def attention_score_flops_per_token(cfg: ModelConfig, seq_len: float, causal: bool = True) -> float:
    """One layer's attention-score FLOPs (QK^T and PV, 2 each per key) per token of a sequence of seq_len,
    averaged over its positions: seq_len keys each, half of them under a causal mask."""
    return 4 * seq_len * cfg.heads * cfg.resolved_head_dim * (0.5 if causal else 1.0)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one forward pass, per token of a sequence of length seq_len."""
    return forward_matmul_flops_per_token(cfg) + cfg.layers * attention_score_flops_per_token(cfg, seq_len, causal)


def layer_prefill_flops(cfg: ModelConfig, tokens: float) -> list[float]:
    """Model FLOPs of each block in a causal forward over a sequence's first `tokens` positions (a prefill from
    an empty cache; the LM head, which a prefill runs on the last position only, left out): its matmuls for every
    token and its attention scores over the keys up to each. What generate's prefill progress is timed by
    (generate/prefill_progress.py): a position's cost grows with the keys before it."""
    scores = attention_score_flops_per_token(cfg, tokens)
    return [tokens * (2 * params + scores) for params in layer_matmul_params(cfg, active=True)]


def prefill_flops(cfg: ModelConfig, tokens: float) -> float:
    """Model FLOPs of a causal forward over a sequence's first `tokens` positions through every block
    (layer_prefill_flops, summed): forward_flops_per_token's per-token figure times `tokens`, less the LM head."""
    return sum(layer_prefill_flops(cfg, tokens))


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def draft_target_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The frozen target's part of a draft-training step (draft_train_flops_per_token): its forward without its
    LM head (hidden states, no backward)."""
    return forward_flops_per_token(cfg, seq_len) - 2 * cfg.dim * cfg.vocab_size


def draft_train_flops_per_token(cfg: ModelConfig, seq_len: int, *, kind: str, layers: int = 1, block: int = 4,
                                vocab: int = 0, kd: bool = False) -> float:
    """Model FLOPs per token of one draft-training step (train/glide.py) against a frozen target of `cfg`:
    - the target's forward without its LM head (hidden states; no_grad: no backward);
    - the draft's own matmuls and attention scores, trained: 3x forward. GliDe (models/glide.py): per
      layer a self-attention, a cross-attention's query and output projections and scores over the
      target's block-stale keys (about as many as causal), the SwiGLU. Clover (models/clover.py): the
      Augmenting Block and the memory's key/value projections once, the regressive step `block` times
      (training is teacher-forced in `block` passes over the sequence);
    - the target's LM head rows the draft scores (`vocab`, 0 = all): frozen, so its forward and the
      gradient to its input only (2x), and under kd (`kd`) the teacher's logits on the same rows (1x)."""
    d, hd = cfg.dim, cfg.resolved_head_dim
    d_attn = cfg.heads * hd
    scores = attention_score_flops_per_token(cfg, seq_len)
    target = draft_target_flops_per_token(cfg, seq_len)
    if kind == "glide":
        draft = layers * (2 * (attention_matmul_params(cfg) + 2 * d * d_attn + dense_ffn_params(cfg)) + 2 * scores)
    elif kind == "clover":
        augmenting = 2 * (attention_matmul_params(cfg) + 3 * d * max(1, cfg.ffn_dim // 2)) + scores
        memory = 2 * 2 * d * cfg.kv_heads * hd
        step = 2 * (2 * d * d + 2 * d * d_attn + 3 * d * max(1, cfg.ffn_dim // 4)) + scores
        draft = augmenting + memory + block * step
    else:
        raise ValueError(f"draft kind must be glide or clover, got {kind!r}")
    head = 2 * d * (vocab or cfg.vocab_size)
    return target + 3 * draft + 2 * head + (head if kd else 0)
