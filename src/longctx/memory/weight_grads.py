"""A block backward's transient bytes that grow with its weights, not its tokens (memory/transients.py adds
them to each phase): autocast's bf16 copies of the weights a recomputation casts afresh, and the weight
gradients autograd sums across the pieces a block runs in (memory/apply_policy.py _in_parts)."""

from __future__ import annotations

from ..config import ModelConfig
from ..models.flops import matmul_params_per_layer
from .policy import MemoryPolicy


def autocast_weight_bytes(m: ModelConfig, policy: MemoryPolicy, moe: bool = False) -> float:
    """What autocast over fp32 weights adds to a block's backward on the device: the bf16 copies of the block's
    matmul weights that its recomputation casts afresh and saves until each matmul's backward (uncached
    autocast, step/loss.py), and the bf16 gradient of the largest weight before it is added to the fp32 one
    (2 B per element each). No copies under `none` (saved activations: accounting.py layer_activations), nor in an
    offloaded block under selective (`policy` with an offload_fraction: _block_backward_bytes passes a kept
    block's without it): its recomputed pieces alias the copy its stored tokens keep (memory/weight_casts.py),
    a saved activation too."""
    d = m.dim
    largest = max(m.ffn_dim, m.heads * m.resolved_head_dim) * d
    if moe and m.is_moe:
        largest = max(largest, m.moe_experts * m.resolved_expert_dim * d)
    recasts = policy.recompute == "full" or (policy.recompute == "selective" and not policy.offload_fraction)
    copies = matmul_params_per_layer(m, moe) if recasts else 0
    return 2.0 * (copies + largest)


def block_pieces(tokens: int, policy: MemoryPolicy) -> int:
    """How many pieces a block's token-wise parts (pre and post) run in (memory/apply_policy.py _in_parts):
    under selective + offload the stored tokens and the recomputed ones, each cut by block_chunk; otherwise
    block_chunk's pieces of all tokens (`none` and unchunked blocks: one call)."""
    if policy.recompute == "none":
        return 1
    count = lambda n: -(-n // policy.block_chunk) if policy.block_chunk and n > policy.block_chunk else int(n > 0)
    stored = round(tokens * policy.offload_fraction) if policy.recompute == "selective" else 0
    return max(1, count(stored) + count(tokens - stored))


def weight_grad_sum_bytes(m: ModelConfig, tokens: int, policy: MemoryPolicy, weight_bytes: int,
                          moe: bool = False) -> dict[str, float]:
    """{"post", "pre"}: the weight gradients a block's backward sums across its pieces (block_pieces > 1).
    Every piece uses each weight of its part, so autograd adds the pieces' gradients of a weight in its
    AccumulateGrad node's input buffer, adding the sum to .grad only once the last piece's has come: through
    post's backward a running sum of each of its weights (the output projection, the feed-forward's and the MLP
    norm's) is alive, and while one is added to, the piece's gradient and the new sum beside the old one (seen
    at the measured peak: aten.add making a new sum). At the weights' own dtype (`weight_bytes`: fp32 under
    autocast, where the cast's backward returns an fp32 gradient per piece). The running sums are storages of
    their own, not the .grad they end in, so the count holds whether .grad is fresh or kept from an earlier
    micro-batch (measured: that one's transient is 1.02x the first's). Measured on CPU, these made
    the peak of a weight-heavy shape (dim 256, ffn 1024, 256 tokens in pieces of 64) 1.4-3x the count without
    them (tests/unit/test_grad_sum_transients.py). A MoE layer's feed-forward: its routed experts' three
    [experts, hidden, dim] weights (all of them: an upper bound under expert parallelism, whose ranks hold
    their share), the router's gate and the shared experts' (measured, a MoE block at 256 tokens in pieces of
    64: 0.61-0.65x the peak in fp32, 0.98x under autocast, without them)."""
    if block_pieces(tokens, policy) <= 1:
        return {"post": 0.0, "pre": 0.0}
    d, hd = m.dim, m.resolved_head_dim
    wo = m.heads * hd * d
    if moe and m.is_moe:
        S = m.resolved_shared_dim
        ffn = [m.moe_experts * m.resolved_expert_dim * d] * 3 + [m.moe_experts * d]
        ffn += [S * d] * 3 + ([d] if m.moe_shared_gate else []) if S else []
    else:
        ffn = [m.ffn_dim * d] * 3
    post = [wo] + ffn
    pre = [m.heads * hd * d, m.kv_heads * hd * d, m.kv_heads * hd * d]
    norms = {"post": d, "pre": d + ((m.heads + m.kv_heads) * hd if m.qk_norm else 0)}  # (q/k norms: at most)
    return {k: weight_bytes * (sum(w) + 2 * max(w) + norms[k]) for k, w in (("post", post), ("pre", pre))}
