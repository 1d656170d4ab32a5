"""Hierarchical expert dispatch in the plan (parallel.expert_ranks_per_node, parallel/expert/hierarchy.py): which
candidates carry it and what a request may ask of it. Its costs are costs/hier_bytes.py's (bytes per link level,
their time) and memory/hier_counts.py's (saved tensors).

The plan takes R from the override --parallel.expert_ranks_per_node=R (planner/cli.py), never on its own: every
expert degree x that R splits into whole nodes (R < x, x % R == 0) is tried both flat and hierarchical, so the search
ranks the two on the same layout, and a plan without the override tries exactly what it did before. R must divide
the node's GPUs (--gpus-per-node), as a run refuses otherwise (job/checks.py _check_expert_nodes): then each of the
group's nodes of R ranks is inside one machine and its exchange on the fast link. FlexMoE's copies do not combine
with it (config/rules.py): a hierarchical candidate has none.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..memory.hier_counts import hierarchical


def node_sizes(ranks_per_node: int, expert: int, copies: int) -> tuple[int, ...]:
    """parallel.expert_ranks_per_node values to try with expert degree `expert` and `copies` FlexMoE slots: 0 (the
    flat exchange), and R too where it makes whole nodes of the group and no copies are asked for."""
    if copies or not hierarchical(expert, ranks_per_node) or expert % ranks_per_node:
        return (0,)
    return (0, ranks_per_node)


def check_expert_nodes(ranks_per_node: int, degrees: tuple[int, ...], gpus_per_node: int, is_moe: bool) -> None:
    """--parallel.expert_ranks_per_node given to the plan: >= 0, a divisor of the node's GPUs, and some expert degree
    tried that it splits into two or more whole nodes (else the override would be inert: said, not ignored)."""
    if not ranks_per_node:
        return
    if ranks_per_node < 0 or gpus_per_node % ranks_per_node:
        raise ConfigError(f"parallel.expert_ranks_per_node = {ranks_per_node} must be a divisor of the GPUs per node "
                          f"({gpus_per_node}: --gpus-per-node), so that each node of the hierarchical dispatch is "
                          f"inside one machine; give a divisor of it, or 0 for the flat all-to-all.")
    usable = [x for x in degrees if hierarchical(x, ranks_per_node) and x % ranks_per_node == 0]
    if not (is_moe and usable):
        raise ConfigError(f"parallel.expert_ranks_per_node = {ranks_per_node} makes the expert all-to-all hierarchical "
                          f"for an expert group of whole nodes of {ranks_per_node} ranks, but the plan tries no such "
                          f"expert degree ({'degrees ' + ','.join(map(str, degrees)) if is_moe else 'a dense model'}): "
                          f"give --expert with a multiple of {ranks_per_node} above it, or drop the override.")
