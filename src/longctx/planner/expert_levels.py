"""Bytes per link level of a MoE layout's step beyond its dense FSDP units (planner/slow_links.py
link_level_bytes adds them): the job's totals of one micro-batch's step, every rank's bytes summed, each on the
hop it takes (ranks placed node by node, as costs/link_bytes.py places them).

- The expert all-to-alls (parallel/expert/install.py), from the planner's own per-rank figures under uniform
  routing (planner/comm_bytes.py: parallel/context/volumes.py expert_bytes, costs/hier_bytes.py
  hier_expert_bytes): each rank's bytes of an exchange spread evenly over its group's other ranks, so the
  share on another node is the share of its peers there. Flat ("expert"): the expert group of `expert`
  adjacent ranks, all inside a node where the group fits in one. Hierarchical ("expert_node", "expert_local"):
  the exchange across hierarchy nodes between the ranks at the same place of each (stride R), the one inside
  a hierarchy node over its R adjacent ranks.
- The routed experts' own FSDP units (parallel/fsdp/shard.py): each MoE block's experts gathered for forward
  and again for backward and reduce-scattered in fp32 over the expert-data group (world / expert ranks, stride
  `expert`: the ranks holding the same experts), whose ring crosses a node on every hop once the stride is a
  node or more.
- Under ZeRO++ the dense units as costs/link_bytes.py counts them; the experts' units gather int8 under qwz
  but keep plain resharding (no hpz) and FSDP's own reduce-scatter (no qgz) (volumes.py fsdp_bytes_per_step).
- The routers' own units where the blocks gather in bf16 (gathered in fp32, over the dense units' group, hpz's
  partition for backward under ZeRO++).
- The router statistics' all-reduce over every rank (parallel/parallelize.py RouterSum, models/moe_stats.py
  router_terms: 3 L E + 2 L + 1 fp32 values per micro-batch, L the MoE layers), of any MoE model over ranks.

Not described (link_level_bytes gives None): FlexMoE's copies (the planner's figure is the hot rank's, not
every rank's), routing across tokens (a capacity, the Sinkhorn router: call_tokens' all-gathers are not
costed), and co2 with expert parallelism (never planned: planner/slow_links.py slow_link_variants).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

from ..config import ModelConfig
from ..costs.link_bytes import Unit, int8_blocks, layout_bytes
from ..costs.model_states import param_shard, unit_param_parts
from ..costs.shape import MeshShape
from ..models.moe_capacity import routes_across_tokens

# the planner's dims of the expert all-to-alls (planner/comm_bytes.py; the comm counters' names)
EXPERT_DIMS = ("expert", "expert_node", "expert_local")
LEVELS = ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes")


def why_not_described(m: ModelConfig, shape: MeshShape, expert_sent: Mapping | None) -> str:
    """Why link_level_bytes cannot give `shape`'s bytes per level ("" where it can)."""
    if routes_across_tokens(m):  # (at any expert degree: parallel/parallelize.py installs them over every rank)
        return "routing across tokens (a capacity, Sinkhorn) gathers the micro-batch's choices, not costed"
    if shape.expert == 1:
        return ""
    if expert_sent is None:
        return "expert parallelism needs the plan's per-rank expert bytes (an Estimate's comm_bytes)"
    if shape.expert_replicas:
        return "FlexMoE's copies move the hot rank's bytes, not every rank's"
    if shape.data_parallel == "co2":  # (the planner tries co2 on expert degree 1 only: slow_links.py)
        return "co2 under expert parallelism (routed experts stay synchronous over the replicas) is not counted"
    return ""


def expert_sent_per_micro_batch(comm_bytes: Mapping[str, Mapping[str, float]],
                                grad_accum: int) -> dict[str, dict[str, float]]:
    """The expert dims of an Estimate's comm_bytes (per rank and optimizer step) per micro-batch."""
    return {d: {label: v / grad_accum for label, v in comm_bytes[d].items()} for d in EXPERT_DIMS if d in comm_bytes}


def _level(a: int, b: int, node: int, group: int) -> int:
    """0: across nodes, 1: inside a node across its groups, 2: inside a group (tests/link_audit.py's rule)."""
    if a // node != b // node:
        return 0
    return 2 if group and a // group == b // group else 1


def _period(world: int, *spans: int) -> int:
    """Ranks after which the placement repeats (every rank where they do not divide the job)."""
    period = math.lcm(*spans)
    return period if world % period == 0 else world


def peer_shares(world: int, stride: int, size: int, node: int, group: int = 0) -> tuple[Fraction, ...]:
    """Over every rank of the job, the sum of the shares of its peers on each level (_level) in an all-to-all
    over groups of `size` ranks `stride` apart (a block of stride x size ranks holds `stride` groups), each
    rank's bytes spread evenly over its size - 1 peers."""
    if size == 1:
        return Fraction(0), Fraction(0), Fraction(0)
    period, block = _period(world, stride * size, node, group or 1), stride * size
    peers = [0, 0, 0]  # (counted as integers, each worth 1 / (size - 1) of its rank's bytes)
    for r in range(period):
        base = r - r % block + r % stride
        for a in range(size):
            if base + a * stride != r:
                peers[_level(r, base + a * stride, node, group)] += 1
    return tuple(Fraction(n * (world // period), size - 1) for n in peers)


def ring_hops(world: int, stride: int, size: int, node: int, group: int = 0) -> tuple[int, ...]:
    """Hops of every ring over groups of `size` ranks `stride` apart, by level (_level): each rank sends to
    the next rank of its group, the last to the first."""
    if size == 1:
        return 0, 0, 0
    period, hops = _period(world, stride * size, node, group or 1), [0, 0, 0]
    for r in range(period):
        nxt = r + stride if (r // stride) % size < size - 1 else r - (size - 1) * stride
        hops[_level(r, nxt, node, group)] += 1
    return tuple(h * (world // period) for h in hops)


def _exchange_groups(shape: MeshShape, dim: str) -> tuple[int, int]:
    """(stride, size) of the groups of the expert exchange `dim`."""
    r = shape.expert_ranks_per_node
    return {"expert": (1, shape.expert), "expert_node": (r, shape.expert // max(r, 1)), "expert_local": (1, r)}[dim]


def exchange_levels(shape: MeshShape, sent: Mapping[str, Mapping[str, float]], node: int,
                    group: int = 0) -> list[float]:
    """The expert all-to-alls' job bytes per level of one micro-batch, from one rank's `sent` {dim: {label:
    bytes}} (every rank sends as much under uniform routing)."""
    total = [0.0, 0.0, 0.0]
    for dim, labels in sent.items():
        stride, size = _exchange_groups(shape, dim)
        shares = peer_shares(shape.world, stride, size, node, group)
        for i in range(3):
            total[i] += float(shares[i]) * sum(labels.values())
    return total


def expert_unit_levels(m: ModelConfig, shape: MeshShape, gather_bytes: int, node: int,
                       group: int = 0) -> list[float]:
    """The routed experts' FSDP units over the expert-data group: per MoE block two gathers (they reshard after
    forward, hpz or not), `gather_bytes` per element or int8 blocks with their scales under qwz (per unit, as
    costs/link_bytes.py counts the dense units'), and one fp32 reduce-scatter (qgz is the dense units'), each
    rank sending its padded shard (param_shard) size - 1 times to its ring successor."""
    size, qwz = shape.expert_data, "qwz" in shape.zero_pp.split(",")
    sent = 0
    for unit in unit_param_parts(m):
        n = sum(param_shard(dims, True, shape.fsdp, shape.expert, size)[0] for dims in unit["experts"])
        gather = int8_blocks(n, shape.quant_block) if qwz else gather_bytes * n
        sent += (2 * gather + 4 * n) * (size - 1) if n else 0
    return [h * sent for h in ring_hops(shape.world, shape.expert, size, node, group)]


def router_unit_levels(router_units: list[Unit], shape: MeshShape, nodes: int, ranks: int,
                       group: int = 0) -> list[float]:
    """The routers' own units (blocks gathered in bf16; routers in fp32, never quantized, reduce-scattered by
    FSDP itself), over the dense units' groups: plain FSDP / HSDP units, or hpz's (backward's gather inside its
    partition) under ZeRO++ (layout_bytes, less the loss's all-reduce it counts)."""
    mode = "hpz" if "hpz" in shape.zero_pp.split(",") else "fsdp"
    args = (nodes, ranks, shape.dp_replicate)
    kw = dict(group=group, hpz_ranks=shape.hpz_ranks)
    with_routers = layout_bytes(mode, router_units, *args, **kw, gather_bytes=4)
    alone = layout_bytes(mode, [], *args, **kw)
    if with_routers is None or alone is None:  # (the dense units' layout_bytes is None then too)
        return [0.0, 0.0, 0.0]
    return [a - b for a, b in zip(_disjoint(with_routers), _disjoint(alone), strict=True)]


def router_sum_bytes(m: ModelConfig, world: int) -> int:
    """Bytes one rank sends per micro-batch in the router statistics' all-reduce over every rank (parallel/
    parallelize.py RouterSum, models/moe_stats.py router_terms: 3 L E + 2 L + 1 fp32 values, L the MoE layers of E
    experts), 2 (n - 1) / n of them as job/comm.py's all_reduce counts a ring (whole bytes; dim and label "router");
    0 for a dense model or one rank (no sum is installed)."""
    if not m.is_moe or world <= 1:
        return 0
    n_layers, experts = len(m.moe_layer_ids), m.moe_experts
    return 2 * 4 * (3 * n_layers * experts + 2 * n_layers + 1) * (world - 1) // world


def router_sum_levels(m: ModelConfig, world: int, node: int, group: int = 0) -> list[float]:
    """The router statistics' ring all-reduce over every rank (consecutive ranks): router_sum_bytes from each rank
    (as costs/link_bytes.py rounds the loss's)."""
    sent = router_sum_bytes(m, world)
    return [h * sent for h in ring_hops(world, 1, world, node, group)]


def _disjoint(levels: Mapping[str, float]) -> list[float]:
    """A link_bytes dict as three disjoint levels: across nodes, a node's hops across its groups, a group's."""
    inter, intra, inner = (levels[k] for k in LEVELS)
    return [inter, intra - inner, inner]


def moe_levels(dense: Mapping[str, int], m: ModelConfig, shape: MeshShape, gather_bytes: int, node: int,
               group: int, expert_sent: Mapping[str, Mapping[str, float]] | None,
               router_units: list[Unit]) -> dict[str, int]:
    """`dense` (the dense units' FSDP bytes per level and the loss's: layout_bytes) and the MoE parts of the
    module docstring, the same keys and meaning: job totals of one micro-batch's step."""
    world = shape.world
    nodes, ranks = max(1, world // node), min(world, node)
    parts = [_disjoint(dense), router_sum_levels(m, world, node, group)]
    if router_units:
        parts.append(router_unit_levels(router_units, shape, nodes, ranks, group))
    if shape.expert > 1:
        parts.append(expert_unit_levels(m, shape, gather_bytes, node, group))
        parts.append(exchange_levels(shape, expert_sent or {}, node, group))
    inter, middle, inner = (round(sum(p[i] for p in parts)) for i in range(3))
    return {"inter_node_bytes": inter, "intra_node_bytes": middle + inner, "intra_group_bytes": inner}
