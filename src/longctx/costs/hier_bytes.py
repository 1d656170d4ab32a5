"""Hierarchical expert dispatch's bytes per link level and their time (parallel.expert_ranks_per_node,
parallel/expert/hierarchy.py): what the planner puts in place of the flat exchange's (parallel/context/volumes.py
expert_bytes, costs/timing.py exposed_expert_seconds).

An expert group of W ranks as N = W / R nodes of R ranks; a rank routes T tokens per MoE layer call, top-k of E
experts, rows of d values at `elem` bytes. Under uniform routing (memory/hier_counts.py: u = remote_nodes, P = T k
pairs per node-rank) one rank sends, per layer:
- across nodes (the comm counters' dim "expert_node", the job's slow link once the group spans nodes), label
  "expert_node": in each forward T u rows of d values plus their k expert ids (int64) and k routing weights (fp32),
  12 k bytes, and T u summed results back (d values); in backward the results' gradients out (d) and the rows' and
  weights' gradients back (d + 4 k). "expert_counts": the rows per node, int64, to the N - 1 other nodes, each
  forward;
- inside the node (dim "expert_local", the fast link), the flat exchange over R ranks on the node-rank's P pairs
  (label "expert": (R - 1) / R of them each way, forward and backward; "expert_counts": the node's E / N experts'
  counts, (R - 1) / R of them, each forward).
A recomputed forward (memory policy) sends its forward bytes again, as the flat exchange does (`forwards`).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..memory.hier_counts import node_share, remote_nodes
from .hardware import Hardware
from .shape import MeshShape, group_is_intra_node
from .timing import expert_straggler_seconds, link_bandwidth

NODE_DIMS = ("expert_node", "expert_local")  # the comm counters' dims of the two levels (parallel/expert/install.py)


def hier_expert_bytes(*, tokens: float, m: ModelConfig, expert: int, ranks_per_node: int, elem: int,
                      forwards: float = 1.0) -> dict[str, dict[str, float]]:
    """{dim: {label: bytes}} one rank sends in one MoE layer's hierarchical dispatch for `tokens` tokens under
    uniform routing (the module docstring)."""
    k, d, experts, r = m.moe_top_k, m.dim, m.moe_experts, ranks_per_node
    nodes = expert // r
    crossing = tokens * remote_nodes(experts, k, nodes)  # T u rows each way
    inter = {"expert_node": forwards * crossing * (2 * d * elem + 12 * k) + crossing * (2 * d * elem + 4 * k),
             "expert_counts": forwards * 8 * (nodes - 1)}
    pairs = tokens * k * (r - 1) / r
    intra = {"expert": 2 * (forwards + 1) * pairs * d * elem,
             "expert_counts": forwards * experts // nodes * 8 * (r - 1) / r}
    return {"expert_node": inter, "expert_local": intra}


def node_group_is_intra(shape: MeshShape, gpus_per_node: int) -> bool:
    """Whether the R ranks of one hierarchy node share a machine: R consecutive ranks of an expert group (itself
    `expert` adjacent ranks) whose start is a multiple of R, inside one node when R divides the node's GPUs (the
    planner tries no other R: planner/request.py)."""
    return shape.expert_ranks_per_node <= gpus_per_node and gpus_per_node % shape.expert_ranks_per_node == 0


def exposed_hier_seconds(m: ModelConfig, shape: MeshShape, step_bytes: dict[str, dict[str, float]], grad_accum: int,
                         tokens: int, skew: float, hw: Hardware, gpus_per_node: int) -> float:
    """costs/timing.py exposed_expert_seconds for the hierarchical dispatch, per micro-batch on the most loaded rank:
    each level's all-to-alls over its own link (blocking, one after the other), the exchange inside the node at
    `skew` x its even share (the hot rank receives those rows), the one across nodes at its node's share
    (hier_counts.node_share: every node-rank of the hot node receives that much), and the experts' GEMMs of the hot
    rank's rows beyond its share, as under the flat exchange (timing.expert_straggler_seconds)."""
    eff = hw.all_to_all_efficiency
    intra_bw = link_bandwidth(hw, node_group_is_intra(shape, gpus_per_node)) * eff
    inter_bw = link_bandwidth(hw, group_is_intra_node(shape, "expert", gpus_per_node)) * eff
    s = max(skew, 1.0)
    inside = sum(step_bytes.get("expert_local", {}).values()) / grad_accum / intra_bw * s
    across = (sum(step_bytes.get("expert_node", {}).values()) / grad_accum / inter_bw
              * node_share(shape.expert, shape.expert_ranks_per_node, s))
    return inside + across + expert_straggler_seconds(m, tokens, s, hw)
