"""What hierarchical expert dispatch (parallel.expert_ranks_per_node, parallel/expert/hierarchy.py) adds to a MoE
layer's backward peak beyond the feed-forward's count (memory/transients.py ffn_backward_bytes, the flat exchange's
working set), for the planner's transient (planner/activation_costs.py rank_transient) and the preflight's
(costs/host_bytes.py predicted_rank_bytes). Its saved tensors are memory/hier_counts.py's.

Per call of T tokens on a rank of the counted node (memory/hier_counts.py: P = T k x node_share (row, choice) pairs
its node-rank receives, S = T x nodes_reached rows it sends across nodes, its own node's included, and R_x = S x
node_share rows it receives across nodes: as many as it sends under even routing), rows of d values at e bytes, the
hierarchical path's own stages hold, beyond the call's saved tensors (each stage's largest set of live buffers,
read off hierarchy.py and measured op by op on 4 gloo ranks: tests/distributed/test_hiertrans109_ranks.py):
- forward combine (steps 3-4): the pairs' rows (models/moe.py _routed holds the dispatch's output until the combine
  returns) and their weighted results, then the summed rows [R_x, d], the rows back [S, d] and the tokens' sum
  [T, d]: max(2 P + R_x, P + R_x + S + T) d e;
- backward of the combine: the rows' gradients back [S, d] and received [R_x, d], then the pairs' gradient [P, d]
  (the sum's backward), the experts' output gradient and the product for the weights' gradient (three of d per
  pair) with that gradient (e per pair): max((S + R_x) d e, (R_x + P) d e, 3 P d e + P e);
- backward of the dispatch: the pairs' rows' gradient (and their weights') beside the received rows' gradient
  summed (zeros, index_add's result: two of d per received row), then the rows' gradient sent back [S, d] beside
  it, and the tokens' gradient (zeros and index_add's result, two of d per token) with the weights' [S, k] (fp32):
  max((P + 2 R_x) d e + P e, (R_x + S + 2 T) d e + 4 S k).
The experts' own backward between the two is the flat exchange's inside the node (the same rows, the same
count). Under even routing with k >= 2 the backward stages fit in the feed-forward's count (at least 3 of d per
(token, choice)), to the weights' few bytes per token where a token's choices reach k nodes: a stored call adds
nothing (measured: the peak equal to the flat exchange's to the byte); with top-1 routing the dispatch's backward
(4 of d per token) exceeds it by one row. A recomputed call (memory.recompute selective or
full) runs its forward inside the backward: the forward combine (P + R_x + S + T of d, against 3 T k) is then
part of the backward's peak, and so are the recomputed call's own saved tensors beyond the flat exchange's
(hier_counts.hier_call_bytes), which the recomputed piece's count (memory/transients.py recomputed_piece_bytes:
block_part_bytes' MoE feed-forward) holds as the flat exchange's. Every buffer is counted at the activations'
dtype e (under bf16 autocast the results are bf16: an upper bound there).
"""

from __future__ import annotations

from ..config import ModelConfig
from .block_parts import compute_bytes
from .hier_counts import expected_pairs_and_sent, hier_call_bytes, hierarchical, node_share
from .peak_routing import over_schedule, peak_top_k
from .policy import MemoryPolicy
from .transients import ffn_backward_bytes, piece_tokens


def hier_stage_bytes(m: ModelConfig, tokens: float, expert: int, ranks_per_node: int, e: int,
                     skew: float = 1.0) -> dict[str, float]:
    """{"forward_combine", "backward_combine", "backward_dispatch"}: the bytes each stage of one hierarchical call
    of `tokens` tokens holds beyond the call's saved tensors (the module docstring), on a node-rank of the most
    loaded rank's node at `skew`."""
    d, k = m.dim, peak_top_k(m)
    pairs, sent = expected_pairs_and_sent(m, tokens, expert, ranks_per_node, skew)
    received = sent * node_share(expert, ranks_per_node, skew)
    return {
        "forward_combine": max(2 * pairs + received, pairs + received + sent + tokens) * d * e,
        "backward_combine": max((sent + received) * d * e, (received + pairs) * d * e, 3 * pairs * d * e + pairs * e),
        "backward_dispatch": max((pairs + 2 * received) * d * e + pairs * e,
                                 (received + sent + 2 * tokens) * d * e + 4 * sent * k),
    }


def hier_transient_bytes(m: ModelConfig, tokens: int, expert: int, ranks_per_node: int, policy: MemoryPolicy,
                         e: int, skew: float = 1.0, autocast: bool = False) -> float:
    """What hierarchical dispatch adds to the backward's peak of one rank (T = `tokens` per micro-batch) beyond
    the feed-forward's count, 0 for the flat exchange: the widest of its stages (hier_stage_bytes) over
    ffn_backward_bytes for the tokens one backward of the feed-forward runs on, a stored piece's (the forward
    combine ran in the forward) and a recomputed piece's (memory/transients.py piece_tokens: its forward combine runs
    in the backward, beside its saved tensors beyond the flat exchange's, hier_counts.hier_call_bytes, in the
    compute dtype as moe_counts counts them), the larger of the two; never below 0. A DTS-Gate model: the largest
    over its schedule (peak_routing.over_schedule)."""
    if not (m.is_moe and hierarchical(expert, ranks_per_node)):
        return 0.0
    return over_schedule(lambda mk: _hier_at(mk, tokens, expert, ranks_per_node, policy, e, skew, autocast), m)


def _hier_at(m: ModelConfig, tokens: int, expert: int, ranks_per_node: int, policy: MemoryPolicy, e: int,
             skew: float, autocast: bool) -> float:
    """hier_transient_bytes at the model's peak_top_k."""
    c = compute_bytes(e, autocast and e == 4)  # (moe_counts' dtype of the saved results, as layer_activations')
    recompute = policy.recompute != "none"
    stored, recomputed = piece_tokens(tokens, policy) if recompute else (tokens, 0.0)

    def beyond_count(n: float, recomputed_piece: bool) -> float:
        if n <= 0:
            return 0.0
        stages = hier_stage_bytes(m, n, expert, ranks_per_node, e, skew)
        widest = max(stages["backward_combine"], stages["backward_dispatch"],
                     stages["forward_combine"] if recomputed_piece else 0.0)
        extra = max(widest - ffn_backward_bytes(m, int(n), e, True, policy.expert_chunk), 0.0)
        return extra + (hier_call_bytes(m, c, n, expert, ranks_per_node, skew) if recomputed_piece else 0.0)

    return max(beyond_count(stored, False), beyond_count(recomputed, True), 0.0)
