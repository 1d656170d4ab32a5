"""plan --validate's hierarchical case (parallel.expert_ranks_per_node, parallel/expert/hierarchy.py): the rows
each rank moves on each level, read off the bare model's first call of every MoE layer, and the planner's own
forms evaluated at those rows, so that the check compares like with like.

The planner prices the hierarchy at one scalar, the hot rank's receive skew (memory/hier_counts.py): the pairs
P a node-rank receives follow it (node_share), the rows S a rank sends across nodes keep their uniform
expectation (nodes_reached). A measured step has rows of its own on every level, which no skew names: the
flat exchange's reading of the experts' counts (validate_experts.py received_skews) means something else
here (the counts are the node's pairs, E / N experts, not the group's routing). So each rank records, per MoE
layer, its tokens T, the rows it sends to each node and receives from each (the node exchange's splits) and its
node-rank's pairs per node expert, and the case compares:
- the saved activations of the rank whose experts received the most rows, against the count at its measured
  receive skew (the experts' rows, as under the flat exchange) with the hierarchy's own saved tensors at its
  measured P and S (hier_counts.hier_call_bytes takes them: the count is linear in both, so this is the
  count of that routing, not an approximation of it), the figure at the expectation reported beside;
- each rank's bytes on the two levels (job/comm.py's counters, dims "expert_node" and "expert_local", one
  forward and backward), against costs/hier_bytes.py's per-layer forms with the measured rows in place of
  the uniform ones (equal to the byte).
What it does not check: the backward's transients (no case of plan --validate measures a peak; the
hierarchy's are measured in tests/distributed/test_hiertrans109_ranks.py), and a recomputed or chunked call
(the case runs memory.recompute none: one stored call of T tokens per MoE layer)."""

from __future__ import annotations

from ..config import ModelConfig
from ..memory.hier_counts import hier_call_bytes
from ..memory.peak_routing import peak_top_k

LEVEL_DIMS = ("expert_node", "expert_local")  # the comm counters' dims of the two levels


def record_routes(layers, dispatcher) -> dict[int, dict]:
    """Wrap the hierarchical `dispatcher` of the MoE `layers` so that each layer's first call records {"tokens",
    "send_rows", "recv_rows" (rows to / from each node), "pairs" (the node-rank's pairs per node expert)} into
    the dict returned."""
    first: dict[int, dict] = {}
    current = [None]
    dispatch = dispatcher.dispatch

    def recording(flat, routing):
        rows, counts, route = dispatch(flat, routing)
        first.setdefault(current[0], {"tokens": int(flat.shape[0]), "send_rows": list(route.send_rows),
                                      "recv_rows": list(route.recv_rows), "pairs": counts.tolist()})
        return rows, counts, route

    def entering(i):
        def hook(mod, args):
            current[0] = i
        return hook
    dispatcher.dispatch = recording  # (one dispatcher serves every layer: the layer's pre-hook says whose call)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(entering(i))
    return first


def _pairs_to(pairs: list[int], owner: int, ranks_per_node: int) -> int:
    """Of a node-rank's pairs per node expert, those for the experts of the node's rank `owner` (local index)."""
    per_owner = len(pairs) // ranks_per_node
    return sum(pairs[owner * per_owner:(owner + 1) * per_owner])


def measured_rows(routes: list[dict], ranks_per_node: int, top_k: int) -> list[dict]:
    """Per rank of the expert group (`routes[q]` record_routes' of group rank q), summed over the MoE layers:
    tokens, pairs (P), sent (S, its own node's rows included), sent_remote / received_remote (across nodes),
    pairs_out / pairs_in (to and from the other ranks of its node), expert_rows (the rows its experts received)
    and receive_skew (those over its own T k)."""
    ep = len(routes)
    out = []
    for q in range(ep):
        node, local = divmod(q, ranks_per_node)
        peers = [node * ranks_per_node + j for j in range(ranks_per_node)]
        fig = dict.fromkeys(("tokens", "pairs", "sent", "sent_remote", "received_remote", "pairs_out", "pairs_in",
                             "expert_rows"), 0)
        for layer, rec in routes[q].items():
            def to_owner(r, j, layer=layer):
                return _pairs_to(routes[r][layer]["pairs"], j, ranks_per_node)
            fig["tokens"] += rec["tokens"]
            fig["pairs"] += sum(rec["pairs"])
            fig["sent"] += sum(rec["send_rows"])
            fig["sent_remote"] += sum(rec["send_rows"]) - rec["send_rows"][node]
            fig["received_remote"] += sum(rec["recv_rows"]) - rec["recv_rows"][node]
            fig["pairs_out"] += sum(to_owner(q, j) for j in range(ranks_per_node) if j != local)
            fig["pairs_in"] += sum(to_owner(r, local) for r in peers if r != q)
            fig["expert_rows"] += sum(to_owner(r, local) for r in peers)
        fig["layers"] = len(routes[q])
        fig["receive_skew"] = fig["expert_rows"] / (fig["tokens"] * top_k) if fig["tokens"] else 1.0
        out.append(fig)
    return out


def level_bytes_at(m: ModelConfig, fig: dict, expert: int, ranks_per_node: int, elem: int) -> dict:
    """costs/hier_bytes.py hier_expert_bytes' forms (one stored forward and its backward per MoE layer) at a rank's
    measured rows `fig` (measured_rows'), summed over its layers: across nodes, the rows sent out with their k ids
    and weights (d e + 12 k) and back as the rows' gradient (d e), the summed rows returned (d e) and their
    gradient with the weights' (d e + 4 k); inside the node, each pair to and from another rank's experts, forward
    and backward (d e each). The counts' all-to-alls are fixed sizes. k: the experts per token of the widest step
    (memory/peak_routing.py peak_top_k, as measured_rows and the saved bytes take it): each row carries the ids and
    weights of its call's experts, E of them in a DTS-Gate run's step 0, which its case runs."""
    k, d, layers = peak_top_k(m), m.dim, fig["layers"]
    nodes = expert // ranks_per_node
    return {
        "expert_node": {"expert_counts": layers * 8 * (nodes - 1),
                        "expert_node": fig["sent_remote"] * (2 * d * elem + 12 * k)
                        + fig["received_remote"] * (2 * d * elem + 4 * k)},
        "expert_local": {"expert": 2 * (fig["pairs_out"] + fig["pairs_in"]) * d * elem,
                         "expert_counts": layers * m.moe_experts // nodes * 8 * (ranks_per_node - 1) // ranks_per_node},
    }


def hier_saved_at(m: ModelConfig, c: int, fig: dict, expert: int, ranks_per_node: int,
                  skew: float) -> tuple[float, float]:
    """(the hierarchy's saved bytes beyond the flat exchange's over a rank's MoE layers at its measured P and S,
    the same at the planner's expectation at `skew`): hier_counts.hier_call_bytes summed over its layers, each one
    stored call of fig's tokens per layer (the layers' P and S enter the count linearly, so their sums do)."""
    layers = fig["layers"]
    tokens = fig["tokens"] / layers
    measured = layers * hier_call_bytes(m, c, tokens, expert, ranks_per_node, skew, pairs=fig["pairs"] / layers,
                                        sent=fig["sent"] / layers)
    expected = layers * hier_call_bytes(m, c, tokens, expert, ranks_per_node, skew)
    return measured, expected
