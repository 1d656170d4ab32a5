"""Bytes per local token of each tensor a block can leave for backward (memory/accounting.py counts them under
a policy and a layout; the transients and host parts read them too): the norms, the attention core's q, k, v,
out and log-sum-exp, the attention output, the residual, the MLP's intermediates (a MoE feed-forward's from
moe_counts.py), the block output; and the dtype each is counted at, under bf16 autocast over fp32 weights too."""

from __future__ import annotations

from ..config import ModelConfig
from .moe_counts import moe_ffn_bytes, moe_norm_feeds


def compute_bytes(e: int, autocast: bool) -> int:
    """Bytes per element of what the matmuls and the attention kernel make (their outputs, the gradients of
    those outputs, the kernel's tensors): under bf16 autocast over fp32 weights (activation_dtype: counted at
    e = 4) bf16, 2; otherwise the activation dtype e itself."""
    return 2 if autocast else e


# the matmuls each block norm's output feeds: under autocast each casts that fp32 output to bf16 for itself and
# saves its cast (uncached autocast, step/loss.py), so a norm keeps one cast per matmul it feeds
ATTENTION_NORM_FEEDS = 3  # wq, wk, wv
MLP_NORM_FEEDS = 2        # w1, w3


def autocast_norm_bytes(d: int, c: int, feeds: int) -> int:
    """Bytes per token a block norm keeps under autocast (its input fp32, the residual stream): the fp32 rsqrt,
    the fp32 normed values, and the `c`-byte cast each of the `feeds` matmuls it feeds makes of its output."""
    return 4 * d + 4 + feeds * c * d


def block_part_bytes(m: ModelConfig, head: int, p: int, docs: bool = False, moe: bool = False,
                     autocast: bool = False) -> dict[str, float]:
    """Bytes per local token of the tensors a block can leave behind, by name; `moe`: a MoE layer's
    block, whose feed-forward keeps `moe_ffn_bytes` (under "mlp", by dtype under autocast too: its `c`) instead of
    the SwiGLU's. `autocast` (bf16 autocast over fp32 weights, p = 4: activation_dtype): what the matmuls and the
    attention kernel make is bf16, the core's q, k, v, out (its log-sum-exp fp32), the attention output and a
    dense MLP's intermediates at 2 B; a norm keeps its fp32 normed values and statistics and the bf16 cast of
    its output that each matmul it feeds makes (the attention norm three, "norm"; the MLP norm two, "mlp_norm");
    a q/k norm its input's fp32 copy and its bf16 normed values; the rest as at 4 B (the fp32 residual stream).
    Without autocast "mlp_norm" is "norm".

    `docs` changes nothing: with packed documents the attention core saves the same q, k, v, out and
    lse. The document ids are an input shared by every block (the batch's), and the segment plans
    that say which query-key pairs attend are host-side numpy (ops/segments.py,
    parallel/context/sequence.py), so no block keeps anything per token for them. (Without a sequence
    layout, distributed_attention gathers the ids once and keeps the [batch, seq] int64 tensor on
    the ids' layout, 8 x head x ctx bytes per local token once per batch, not per block; the
    training loop always plans a layout on the host and gathers nothing.)"""
    d, hd, H, K, F = m.dim, m.resolved_head_dim, m.heads, m.kv_heads, m.ffn_dim
    k_eff = max(K, head)  # kv heads after replication for the head-parallel all-to-all
    c = compute_bytes(p, autocast and p == 4)  # the matmuls' and the attention kernel's outputs
    # RMSNorm keeps fp32 rsqrt (4 B) and 8d more bytes: in fp32 the normed x and the output (its
    # input, saved too, IS the block input or the residual h); in bf16 an fp32 copy of the input,
    # the bf16 normed x and the output
    norm = mlp_norm = 8 * d + 4
    if c < p:
        # autocast: the norm's fp32 output is not kept, but each matmul it feeds casts it to bf16 and keeps
        # that cast
        # (a MoE feed-forward's router reads it in fp32, its experts their permuted rows: moe_norm_feeds)
        mlp_feeds = moe_norm_feeds(m) if moe and m.is_moe else MLP_NORM_FEEDS
        norm, mlp_norm = autocast_norm_bytes(d, c, ATTENTION_NORM_FEEDS), autocast_norm_bytes(d, c, mlp_feeds)
    # model.qk_norm (Qwen3, OLMoE): the q and k norms (ops/norm.py rms_norm, in the sequence layout
    # before the all-to-all: every head) keep their input's fp32 copy (the input itself in fp32), the
    # normed values in the input's dtype (the projection's: c), and an fp32 rsqrt per row (a head's vector,
    # or the whole projection under qk_norm_span "all"); RoPE after them keeps nothing of its input
    qk_rows = (2 if getattr(m, "qk_norm_span", "head") == "all" else H + K) if m.qk_norm else 0
    qk_norm = (4 + c) * (H + K) * hd + 4 * qk_rows if m.qk_norm else 0
    core = c * (2 * H + 2 * k_eff) * hd + 4 * H
    return {
        "norm": norm,                                  # the attention norm
        "mlp_norm": mlp_norm,
        "qk_norm": qk_norm,
        "norm_input": p * d if p == 4 else 0,          # fp32: the norm saves its input itself
        "core": core,                                  # q, k, v, out, lse
        "attn_out": c * H * hd,                        # the attention output in sequence layout
        "residual": p * d if p == 4 else 0,            # h = x + attention, kept as the MLP norm's input
        # w1 out, silu out, w3 out, product; a MoE feed-forward's router, permutation and experts
        "mlp": moe_ffn_bytes(m, p, c) if moe and m.is_moe else 4 * c * F,
        "block_out": p * d,
    }
