"""Hierarchical expert dispatch (parallel.expert_dispatch = hierarchical): across nodes once per
token and node, then inside the node.

With the flat exchange (parallel/expert.py) a token routed to k experts travels k times, and when
two of them live on the same remote node its row crosses the slow inter-node link twice, and its
k results cross it back twice. Here an expert group of W ranks is seen as N nodes of R ranks
(rank = node x R + local, as the ranks are placed) and a layer call runs:

  1. across nodes (the `expert_node` group: the ranks with the same local index on every node):
     each token's row goes once to every node that holds one of its experts, to the rank with the
     sender's own local index there, with the token's choices on that node (expert ids and routing
     weights; -1 / 0 elsewhere);
  2. inside that node (the `expert_local` group): the received rows, one per (row, choice), go to
     their experts' owners by the flat exchange of parallel/expert.py (pipelined chunks included);
  3. back inside the node, and each row's results on the node are weighted and summed there;
  4. back across nodes: one summed row per token and node, added up on the token's rank.

A token's row crosses nodes once per remote node it uses instead of once per remote choice, and
its results likewise: for top-2 of 16 experts on 2 nodes, uniform routing, 1 - (8/16)(7/15) = 0.77
of the flat bytes (more saved as k grows or as a token's experts share nodes). The routing weights
travel with the rows (k values per row), so their gradient flows back through the same transfers:
every step is an autograd op (the all-to-alls' backward swaps their splits), the result is the
flat exchange's up to the order of the k-term sums.
"""

from __future__ import annotations

import torch

from . import comm


def _send_plan(choice: torch.Tensor, node_of_choice: torch.Tensor, nodes: int):
    """For every node m: the tokens with a choice there (ascending). Returns the token index of
    every row sent (node-major), the rows per node, and for each sent row its k choices' positions
    kept (True where the choice is on that row's node)."""
    t, k = choice.shape
    on = torch.stack([(node_of_choice == m) for m in range(nodes)])  # [N, T, k]
    uses = on.any(-1)  # [N, T]
    node_idx, token = uses.nonzero(as_tuple=True)  # node-major, ascending tokens
    rows = torch.bincount(node_idx, minlength=nodes)
    return token, rows, on[node_idx, token]  # [n, k] which choices of each sent row


def hierarchical_routed(flat: torch.Tensor, routing, *, experts, meshes, local: int, run_flat) -> torch.Tensor:
    """The routed experts' weighted sum for every token of `flat` [T, dim], by the four steps of the
    module docstring. meshes = (node group, local group); `local` experts per rank; run_flat(x,
    counts, mesh) is parallel/expert.py's flat exchange over a group (rows sorted by expert)."""
    inter, intra = meshes
    nodes, per_node = inter.size(), intra.size()
    choice, weights = routing.experts, routing.weights.float()
    if routing.kept is not None:  # a dropped choice goes nowhere (its weight is zero anyway)
        weights = weights * routing.kept
        choice = torch.where(routing.kept, choice, -1)
    node_of = torch.where(choice >= 0, choice // (local * per_node), -1)
    token, rows, mask = _send_plan(choice, node_of, nodes)
    send_rows = rows.tolist()  # the host read the exchange needs (split sizes), as in the flat path
    recv_rows = comm.all_to_all(rows.view(nodes, 1), inter, label="expert_counts").view(-1).tolist()
    ids = torch.where(mask, choice[token], -1)
    w = torch.where(mask, weights[token], 0.0)
    got = comm.AllToAllV.apply(flat.index_select(0, token), inter, send_rows, recv_rows, "expert_node")
    got_ids = comm.all_to_all_v(ids, inter, send_rows, recv_rows, label="expert_node")
    got_w = comm.AllToAllV.apply(w, inter, send_rows, recv_rows, "expert_node")
    # 2-3: one row per (received row, choice on this node), sorted by expert, through the node's owners
    base = comm.local_rank(inter) * per_node * local  # this node's first expert
    row, slot = (got_ids >= 0).nonzero(as_tuple=True)
    expert = got_ids[row, slot] - base
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=per_node * local)
    out = run_flat(got.index_select(0, row[order]), counts, intra)
    pair_w = got_w[row[order], slot[order]].to(out.dtype)
    summed = out.new_zeros(got.shape[0], out.shape[1]).index_add(0, row[order], out * pair_w[:, None])
    # 4: back to the tokens' ranks, one row per (token, node), added up per token
    back = comm.AllToAllV.apply(summed, inter, recv_rows, send_rows, "expert_node")
    return flat.new_zeros(flat.shape[0], back.shape[1]).index_add(0, token, back.to(flat.dtype))
