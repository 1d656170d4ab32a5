"""Hierarchical expert dispatch (parallel.expert_ranks_per_node): across nodes once per token and
node, then inside the node.

With the flat exchange (parallel/expert/dispatch.py) a token routed to k experts travels k times, and when
two of them live on the same remote node its row crosses the slow inter-node link twice, and its
k results cross it back twice. Here an expert group of W ranks is seen as N nodes of R ranks
(rank = node x R + local, as the ranks are placed) and a layer call runs:

  1. across nodes (the `expert_node` group: the ranks with the same local index on every node):
     each token's row goes once to every node that holds one of its experts, to the rank with the
     sender's own local index there, with the token's choices on that node (expert ids and routing
     weights; -1 / 0 elsewhere);
  2. inside that node (the `expert_local` group): the received rows, one per (row, choice), go to
     their experts' owners by the flat exchange (ExpertParallelDispatcher.run_experts over the
     node, pipelined chunks included);
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

from dataclasses import dataclass

import torch

from ...job import comm
from ...ops.eager import eager_under_compile
from .dispatch import ExpertParallelDispatcher


def _send_plan(choice: torch.Tensor, node_of_choice: torch.Tensor, nodes: int):
    """For every node m: the tokens with a choice there (ascending). Returns the token index of
    every row sent (node-major), the rows per node, and for each sent row its k choices' positions
    kept (True where the choice is on that row's node)."""
    t, k = choice.shape
    on = torch.stack([(node_of_choice == m) for m in range(nodes)])  # [N, T, k]
    uses = on.any(-1)  # [N, T]
    node_idx, token = uses.nonzero(as_tuple=True)  # node-major, ascending tokens
    rows = torch.bincount(node_idx, minlength=nodes)
    # (token a copy: nonzero(as_tuple=True) gives views of one [2, n] storage, all of which the combine kept)
    return token.clone(), rows, on[node_idx, token]  # [n, k] which choices of each sent row


class RowSums(torch.autograd.Function):
    """[rows, dim] zeros with each row of `src` added to row index[i]: index_add, whose backward keeps `index`
    only. torch's index_add saves its source for backward as well (derivatives.yaml: expand_as(source)), and
    the combine's two sums kept the node's results [pairs, dim] and the returned rows [sent, dim] once more per
    MoE layer: measured 0.52 MB more than the flat exchange in a debug-moe block of 256 tokens, 0.02 MB now."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return src.new_zeros(rows, src.shape[1]).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


@dataclass
class NodeRoute:
    """What the hierarchical dispatch hands its combine: the tokens' rows (`flat`) and the index of
    every row sent across nodes (`token`, node-major) with the rows per node each way; for each
    (received row, choice) pair, in the order the experts got them, its received row and weight."""
    flat: torch.Tensor
    token: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]
    received: int
    pair_row: torch.Tensor
    pair_weight: torch.Tensor


class HierarchicalDispatcher(ExpertParallelDispatcher):
    """parallel.expert_ranks_per_node: the four steps of the module docstring. dispatch is step 1
    and the (row, choice) pairs of this node sorted by expert; run_experts is the flat exchange over
    the node (`nodes[1]`, pipelined chunks included; the weights' gradient scale the whole group's);
    combine is steps 3-4. nodes = (across nodes, inside a node): parallel/expert/install.py node_meshes."""

    def __init__(self, group_size: int, nodes, chunks: int = 1, tuner=None):
        inter, intra = nodes
        super().__init__(intra, chunks, tuner, group_size=group_size)
        self.inter = inter

    def _route(self) -> str:
        return f"hierarchical over {self.inter.size()} nodes of {self.mesh.size()} ranks"

    # Eager under train.compile, as run_experts is (dispatch.py): both are driven by the host (the split sizes read
    # as lists, the all-to-alls), and Dynamo traced them: a graph for every new set of split sizes until its
    # recompile limit (seen: 80 s instead of 3 for 3 debug-moe steps on CPU), guards on the counts every call
    @eager_under_compile
    def dispatch(self, flat: torch.Tensor, routing) -> tuple[torch.Tensor, torch.Tensor, NodeRoute]:
        inter, intra = self.inter, self.mesh
        nodes, per_node = inter.size(), intra.size()
        local = routing.probs.shape[-1] // self.group_size  # experts per rank
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
        got = comm.all_to_all_v_grad(flat.index_select(0, token), inter, send_rows, recv_rows, "expert_node")
        got_ids = comm.all_to_all_v(ids, inter, send_rows, recv_rows, label="expert_node")
        got_w = comm.all_to_all_v_grad(w, inter, send_rows, recv_rows, "expert_node")
        # 2: one row per (received row, choice on this node), sorted by expert, for the node's owners
        base = comm.local_rank(inter) * per_node * local  # this node's first expert
        row, slot = (got_ids >= 0).nonzero(as_tuple=True)
        expert = got_ids[row, slot] - base
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=per_node * local)
        pair_row, pair_slot = row[order], slot[order]  # (one tensor: the gather and the combine's sum keep it)
        route = NodeRoute(flat, token, send_rows, recv_rows, got.shape[0], pair_row, got_w[pair_row, pair_slot])
        return got.index_select(0, route.pair_row), counts, route

    @eager_under_compile
    def combine(self, out: torch.Tensor, route: NodeRoute) -> torch.Tensor:
        # 3: each received row's results on this node, weighted and summed
        pair_w = route.pair_weight.to(out.dtype)
        summed = RowSums.apply(out * pair_w[:, None], route.pair_row, route.received)
        # 4: back to the tokens' ranks, one row per (token, node), added up per token
        back = comm.all_to_all_v_grad(summed, self.inter, route.recv_rows, route.send_rows, "expert_node")
        return RowSums.apply(back.to(route.flat.dtype), route.token, route.flat.shape[0])
