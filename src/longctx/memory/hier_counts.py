"""What hierarchical expert dispatch (parallel.expert_ranks_per_node, parallel/expert/hierarchy.py) changes in a MoE
call's saved bytes, and the routing expectations its counts (and costs/hier_bytes.py's link bytes) rest on.

An expert group of W = `expert` ranks is N = W / R nodes of R ranks. Under uniform routing a token's k choices are a
uniformly random k-subset of the E experts, so the chance that it misses one node (E / N experts) is
C(E - E/N, k) / C(E, k): it reaches `nodes_reached` = N (1 - that) nodes on average, its own among them, and
`remote_nodes` = (N - 1) (1 - that) others (the rows that cross the slow link). What skew does to these is in
docs/moe.md ("Hierarchical dispatch in the planner").

Per call of T tokens on a rank, with S = the rows it sends across nodes (its own node's included: T x
nodes_reached) and P = the (row, choice) pairs its node-rank receives for the node's experts, a stored call keeps,
beyond the flat exchange's count (memory/moe_counts.py moe_call_terms; c: the experts' output bytes, the
project's compute dtype as the flat count's):
  + S (8 + k): the sent rows' token index (int64: the gather, the weights' gather and the final sum share it) and
    the bool [S, k] mask of which choices are on each row's node (the weights' `torch.where`);
  + P (c d + c + 16): the weighted sum's saved experts' output [P, d] and its weights (cast to the output's dtype),
    and the pairs' int64 row and slot (the gather of the rows and of their weights);
  - T k (c d + 8 + c), and with a capacity T k (8 + c d) more: what the flat combine keeps and this one does not
    (moe_ffn_bytes' un-permute: the gathered slots and, with a capacity, index_copy's index and source; the permute's
    int64 inverse permutation; the routing weights the flat combine multiplies).
The experts themselves see the same rows as under the flat exchange (each pair reaches its expert's owner once), so
their count (expert_rows, expert_parallel_row_bytes) is unchanged.
"""

from __future__ import annotations

from math import comb

from ..config import ModelConfig
from .peak_routing import peak_top_k


def hierarchical(expert: int, ranks_per_node: int) -> bool:
    """Whether parallel.expert_ranks_per_node makes the dispatch hierarchical (parallel/expert/install.py: 0 <
    R < the expert group; R must divide it, config/rules.py)."""
    return expert > 1 and 0 < ranks_per_node < expert


def miss_chance(experts: int, top_k: int, nodes: int) -> float:
    """The chance that a token's k choices (a uniform k-subset of the experts) avoid one given node's experts."""
    return comb(experts - experts // nodes, top_k) / comb(experts, top_k)


def nodes_reached(experts: int, top_k: int, nodes: int) -> float:
    """Nodes a token's k choices touch on average under uniform routing, its own node included."""
    return nodes * (1.0 - miss_chance(experts, top_k, nodes))


def remote_nodes(experts: int, top_k: int, nodes: int) -> float:
    """u: the other nodes a token's row is sent to (and its summed result comes back from), on average."""
    return (nodes - 1) * (1.0 - miss_chance(experts, top_k, nodes))


def node_share(expert: int, ranks_per_node: int, skew: float) -> float:
    """The pairs a node-rank of the most loaded rank's node receives over an even share (T k): the node's R ranks
    receive skew + (R - 1) (W - skew) / (W - 1) shares together (the planner's skew: the hot rank at `skew`, the
    others even, planner/expert_copies.py skewed_load), and the ranks with each local index of the N nodes send
    alike, so each of the node's R node-ranks receives 1 / R of them. 1 under even routing."""
    s, w, r = max(skew, 1.0), expert, ranks_per_node
    return (s + (r - 1) * (w - s) / (w - 1)) / r


def hier_pair_row_bytes(m: ModelConfig, c: int) -> float:
    """Bytes a stored call keeps per (row, choice) pair its node-rank receives (the module docstring's P term)."""
    return c * m.dim + c + 16


def hier_sent_row_bytes(m: ModelConfig) -> float:
    """Bytes a stored call keeps per row it sends across nodes, its own node's included (the S term)."""
    return 8 + peak_top_k(m)


def flat_combine_slot_bytes(m: ModelConfig, c: int) -> float:
    """Bytes per routed slot (token x choice) the flat dispatch's permute and combine keep, which the hierarchical
    one does not (the module docstring's T k term)."""
    capacity = 8 + c * m.dim if m.moe_capacity_factor > 0 else 0
    return c * m.dim + 8 + c + capacity


def expected_pairs_and_sent(m: ModelConfig, tokens: float, expert: int, ranks_per_node: int,
                            skew: float = 1.0) -> tuple[float, float]:
    """(P, S) of a call of `tokens` tokens under the planner's routing: the (row, choice) pairs a node-rank of the
    most loaded rank's node receives at `skew`, and the rows a rank sends across nodes, its own node's included."""
    k = peak_top_k(m)
    pairs = tokens * k * node_share(expert, ranks_per_node, skew)
    return pairs, tokens * nodes_reached(m.moe_experts, k, expert // ranks_per_node)


def hier_call_bytes(m: ModelConfig, c: int, tokens: float, expert: int, ranks_per_node: int, skew: float = 1.0,
                    pairs: float | None = None, sent: float | None = None) -> float:
    """Bytes a stored MoE call of `tokens` tokens keeps under hierarchical dispatch beyond the flat exchange's count
    (the module docstring), on the most loaded rank's node at `skew`; `pairs` / `sent`: P and S as a run measured
    them (None: their expectation, expected_pairs_and_sent)."""
    expected_pairs, expected_sent = expected_pairs_and_sent(m, tokens, expert, ranks_per_node, skew)
    pairs = expected_pairs if pairs is None else pairs
    sent = expected_sent if sent is None else sent
    return (pairs * hier_pair_row_bytes(m, c) + sent * hier_sent_row_bytes(m)
            - tokens * peak_top_k(m) * flat_combine_slot_bytes(m, c))
