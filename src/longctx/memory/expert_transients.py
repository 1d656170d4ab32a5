"""What expert parallelism adds to a MoE layer's backward transient beyond memory/transients.py's count: the most
loaded rank's extra received rows at a receive skew (`expert_skew_transient_bytes`) and the gradient rows in flight
while the shared experts' backward overlaps the return transfer (`shared_overlap_transient_bytes`). Routed rows per
token at memory/peak_routing.py peak_top_k, as every memory count takes them.
"""

from __future__ import annotations

from ..config import ModelConfig
from .block_parts import compute_bytes
from .moe_counts import expert_rows
from .peak_routing import over_schedule, peak_top_k
from .policy import MemoryPolicy
from .transients import ffn_backward_bytes


def expert_skew_transient_bytes(m: ModelConfig, tokens: int, expert: int, skew: float, policy: MemoryPolicy,
                                e: int) -> float:
    """What the most loaded rank of an expert group holds beyond an even share while one MoE layer
    runs (on top of its saved count, memory.moe_counts.moe_call_terms): the extra received rows in
    the all-to-all's output, its expert-major copy, the experts' output and its source-major copy
    (4 x dim), and in backward their gradients (3 of dim, an fp32 count) and, unless memory.
    expert_chunk bounds them to a piece, the experts' recomputed or kept intermediates' gradients
    (4 x expert_dim). A DTS-Gate model: the largest over every k its schedule routes (top_k to peak_top_k: at E
    every rank receives all its tokens' rows, no skew; a later step can skew)."""
    if expert == 1 or not m.is_moe or skew <= 1.0:
        return 0.0
    extra = max(expert_rows(tokens, m, expert, skew, k) - tokens * k for k in range(m.moe_top_k, peak_top_k(m) + 1))
    per_row = 4 * e * m.dim + 3 * e * m.dim + 4 + (0 if policy.expert_chunk else 4 * e * m.resolved_expert_dim)
    return max(extra, 0.0) * per_row


def shared_overlap_transient_bytes(m: ModelConfig, tokens: int, expert: int, policy: MemoryPolicy, e: int,
                                   autocast: bool = False) -> float:
    """What overlapping a MoE layer's shared experts with the expert-parallel return transfer adds to its
    backward's peak (parallel/expert/dispatch.py run_experts_beside): their backward runs while the routed
    results' gradients travel out, so the gradient rows sent and the buffer they arrive in (two of dim per
    row, top_k rows per token) are alive beside the shared experts' own gradients. Beyond the feed-forward's
    count (ffn_backward_bytes: the larger of the routed and the shared phases), for the tokens one backward
    of the feed-forward runs on (a block chunk's, or all of them); counted whatever the pipelined chunks
    (with them the layer does not overlap: an upper bound); under `autocast` these are the matmuls' bf16
    outputs and gradients (compute_bytes). Measured on 4 gloo ranks: +0.53 MB for 512 tokens of k 2, dim 64
    in fp32, this count 0.52 MB (docs/benchmarks.md). A DTS-Gate model: the largest over its schedule
    (peak_routing.over_schedule)."""
    if expert == 1 or not m.is_moe or not m.resolved_shared_dim:
        return 0.0
    return over_schedule(lambda mk: _overlap_at(mk, tokens, policy, e, autocast), m)


def _overlap_at(m: ModelConfig, tokens: int, policy: MemoryPolicy, e: int, autocast: bool) -> float:
    """shared_overlap_transient_bytes at the model's peak_top_k."""
    e = compute_bytes(e, autocast)
    piece = min(policy.block_chunk, tokens) if policy.block_chunk and policy.recompute != "none" else tokens
    counted = ffn_backward_bytes(m, piece, e, True, policy.expert_chunk)
    gate = e * m.dim if m.moe_shared_gate else 0
    overlapped = piece * (3 * e * m.resolved_shared_dim + gate + 2 * e * peak_top_k(m) * m.dim)
    return max(overlapped - counted, 0.0)
