"""Slow links in the planner (issue 50): CO2's local rounds and Frontier's third hpZ level as candidate
layouts, what they cost, and the bytes a plan puts on each link level.

- CO2 (train.data_parallel = co2, step/co2.py): each of the r replicas is its own FSDP group, so no
  gradient crosses replicas per step; every H = train.co2_local_steps steps each rank all-reduces its
  shard's change (fp32, 2 (r - 1) / r of it) over the replicas, overlapped with the next round's H
  steps. Exposed per step: max(0, all-reduce - H x step compute) / H (the overlap scaled by
  hardware.comm_overlap, 1 on GPUs). Memory: OuterSync keeps, per parameter of the rank's shard, the
  round's start, the outer model (anchor) and the change in flight in fp32, and the outer momentum when
  train.co2_outer_momentum > 0 (3 or 4 x 4 bytes, on the device: co2 needs memory.model_states = device).
  CO2 changes convergence, so the planner ranks it only under `--allow co2`; otherwise it reports the best
  co2 plan beside the chosen one (link_report.py).
- Three levels (parallel.hpz_ranks, hardware.group_ranks / middle_gbps): under ZeRO++ the backward's
  gathers can read a secondary partition over one group of the node (at intra_gbps) instead of the whole
  node (across its groups at middle_gbps), holding 1 / group instead of 1 / node of the blocks.
- Bytes per link level: bench comm's closed forms (costs/link_bytes.py; the emulated cluster's counts
  equal them for one FSDP group over every rank and for co2 with one replica per node), composed over
  the layout's replicas by the same ring rule (layout_bytes: HSDP, co2 replicas of any size that nest
  in nodes). A MoE layout adds its expert all-to-alls on the level each exchange's group spans, the routed
  experts' and the routers' own FSDP units, and the router statistics' all-reduce (planner/expert_levels.py).
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..costs.hardware import Hardware
from ..costs.link_bytes import Unit, fsdp_unit, layout_bytes
from ..costs.model_states import co2_params, even_shards, unit_param_parts, unit_param_shapes
from ..costs.shape import MeshShape, group_is_intra_node
from ..costs.timing import exposed, link_bandwidth
from ..errors import ConfigError
from .expert_levels import moe_levels, why_not_described

CO2_CAVEAT = ("co2 changes convergence: on the debug model over 8 ranks for 300 steps it ended 3.9% (H=2) to 10% "
              "(H=4) above sync's final loss (docs/benchmarks.md); check the loss against a sync run")
# train.co2_local_steps values tried: the smallest that hides the outer all-reduce is chosen (less staleness)
CO2_LOCAL_STEPS = (2, 4, 8)


def co2_outer_bytes(m: ModelConfig, shape: MeshShape) -> float:
    """Bytes one rank sends in one round's outer all-reduce: 2 (r - 1) / r of its fp32 shard."""
    r = shape.dp_replicate
    return 2 * (r - 1) / r * 4 * co2_params(m, shape)


def co2_outer_seconds(m: ModelConfig, shape: MeshShape, hw: Hardware, gpus_per_node: int) -> float:
    """One round's outer all-reduce over the replicas' link (across nodes where the replicas are)."""
    intra = group_is_intra_node(shape, "replicate", gpus_per_node)
    return co2_outer_bytes(m, shape) / link_bandwidth(hw, intra)


def co2_exposed_seconds(allreduce_s: float, step_compute_s: float, local_steps: int, hw: Hardware,
                        overlap: int = 0) -> float:
    """Per step, what of the outer all-reduce the steps before its merge do not hide: max(0, allreduce
    - d x compute) / H where comm_overlap is 1, d = train.co2_overlap_steps (0: H, CO2's full overlap;
    the round's average is merged, so waited for, d steps after the round end: step/co2.py)."""
    hidden_under = min(overlap, local_steps) if overlap else local_steps
    return exposed(allreduce_s, hidden_under * step_compute_s, hw) / local_steps


def co2_local_steps(allreduce_s: float, step_compute_s: float, hw: Hardware,
                    tried: tuple[int, ...] = CO2_LOCAL_STEPS, overlap: int = 0) -> int:
    """The smallest H of `tried` that hides the outer all-reduce whole (fewer local steps: less
    staleness), else the largest (the least exposed); only H >= overlap (train.co2_overlap_steps must
    be at most train.co2_local_steps)."""
    allowed = sorted(h for h in tried if h >= overlap)
    for h in allowed:
        if co2_exposed_seconds(allreduce_s, step_compute_s, h, hw, overlap) == 0:
            return h
    return max(allowed)


def check_levels(hw: Hardware, gpus_per_node: int) -> None:
    """A third link level must be usable: a group size dividing the node, and the link between groups."""
    g = hw.group_ranks
    if g and (hw.middle_gbps <= 0 or gpus_per_node % g):
        raise ConfigError(f"hardware {hw.name}: group_ranks = {g} describes a third link level, which needs "
                          f"middle_gbps > 0 (the link between a node's groups, got {hw.middle_gbps:g}) and a group "
                          f"size dividing the {gpus_per_node} GPUs per node; set both (--hw group_ranks=2 --hw "
                          f"middle_gbps=100), or group_ranks = 0 for two levels.")


def three_level(hw: Hardware, gpus_per_node: int) -> int:
    """The group size of a third link level that hpZ can use inside a node of `gpus_per_node`, else 0."""
    g = hw.group_ranks
    return g if g and 1 < g < gpus_per_node and gpus_per_node % g == 0 else 0


def slow_link_variants(shape: MeshShape, hw: Hardware, gpus_per_node: int, co2: bool) -> list[MeshShape]:
    """Layouts derived from `shape` for slow links: ZeRO++ with hpZ on a node's group (three-level
    hardware), and co2 where replicas are linked across nodes (dense layers' parameters, over plain FSDP
    replicas: the bytes below price co2 without zero_pp, which a run may still add), its local_steps left 0
    for the estimate to settle."""
    out = []
    group = three_level(hw, gpus_per_node)
    if group and "hpz" in shape.zero_pp.split(",") and not shape.hpz_ranks:
        out.append(dataclasses.replace(shape, hpz_ranks=group))
    if (co2 and shape.dp_replicate > 1 and not shape.zero_pp and shape.expert == 1
            and not group_is_intra_node(shape, "replicate", gpus_per_node)):
        out.append(dataclasses.replace(shape, data_parallel="co2"))
    return out


# ----------------------------------------------------------------------------------------------
# Bytes per link level


def planner_units(m: ModelConfig, group: int, node: int, hpz: int = 0, even: bool = True,
                  parts: tuple[str, ...] = ()) -> list[Unit]:
    """One FSDP unit per block and the root, their shards per rank as FSDP2 cuts them (costs/link_bytes.py
    fsdp_unit, from the parameters' shapes, as bench comm counts them; `even` False under hpz: dim 0). Not
    ceil(params / group): where the group does not divide a dim 0 that read 1.5% low on 2 x 3 ranks. `parts`:
    only those of costs/model_states.py unit_param_parts ("dense", "router", "experts"; (): every parameter)."""
    if parts:
        *blocks, root = ([dims for part in parts for dims in unit[part]] for unit in unit_param_parts(m))
    else:
        *blocks, root = unit_param_shapes(m)
    return [*(fsdp_unit(b, group, node, hpz, even) for b in blocks), fsdp_unit(root, group, node, even=even, root=True)]


def bench_mode(shape: MeshShape) -> str | None:
    """bench comm's mode for `shape`'s FSDP transfers, or None where it has none."""
    if shape.data_parallel == "co2":
        return "co2" if not shape.zero_pp else None
    return {"": "fsdp", "hpz,qwz,qgz": "three_level" if shape.hpz_ranks else "zeropp"}.get(shape.zero_pp)


def link_level_bytes(m: ModelConfig, shape: MeshShape, hw: Hardware, gpus_per_node: int,
                     expert_sent: dict[str, dict[str, float]] | None = None) -> dict[str, int] | None:
    """{"inter_node_bytes", "intra_node_bytes", "intra_group_bytes"}: the job's bytes of one step of one
    micro-batch (bench comm's step; co2's outer all-reduce 1 / H of a round's), every rank's summed, by link
    level (intra_group_bytes: the part of intra_node_bytes inside a three-level group): FSDP / ZeRO++ / CO2's
    (costs/link_bytes.py layout_bytes: bench comm's closed forms, over `shape`'s replicas) and, for a MoE model,
    its router statistics' all-reduce and under expert parallelism the expert all-to-alls (`expert_sent`: one
    rank's per micro-batch, expert_levels.expert_sent_per_micro_batch of the plan's Estimate) and the experts'
    own FSDP units (planner/expert_levels.py). None where they do not describe the layout: groups that do not
    nest in nodes, and the expert layouts expert_levels.why_not_described names (FlexMoE's copies, routing
    across tokens, co2 with experts, no per-rank expert bytes given)."""
    world, mode = shape.world, bench_mode(shape)
    if mode is None or world == 1 or why_not_described(m, shape, expert_sent):
        return None
    nodes, ranks = max(1, world // gpus_per_node), min(world, gpus_per_node)
    group = three_level(hw, gpus_per_node)
    # under expert parallelism the routed experts are units of their own (expert_levels); where the blocks
    # gather bf16 each router is too, gathered in fp32, at any expert degree (parallel/fsdp/shard.py); under co2
    # (expert 1 only) they stay in the blocks' units, which co2's outer all-reduce counts with the rest
    apart = m.is_moe and shape.expert > 1
    own_routers = m.is_moe and hw.dtype_bytes != 4 and shape.data_parallel != "co2"
    in_blocks = ("dense", *(() if own_routers else ("router",)), *(() if apart else ("experts",)))
    units = planner_units(m, shape.fsdp, min(shape.fsdp, ranks), shape.hpz_ranks, even_shards(shape),
                          in_blocks if m.is_moe else ())
    levels = layout_bytes(mode, units, nodes, ranks, shape.dp_replicate, block=shape.quant_block,
                          local_steps=shape.local_steps or
                          max(CO2_LOCAL_STEPS), group=group, hpz_ranks=shape.hpz_ranks, gather_bytes=hw.dtype_bytes)
    if levels is None or not m.is_moe:
        return levels
    routers = (planner_units(m, shape.fsdp, min(shape.fsdp, ranks), shape.hpz_ranks, even_shards(shape), ("router",))
               if own_routers else [])
    return moe_levels(levels, m, shape, hw.dtype_bytes, gpus_per_node, group, expert_sent, routers)
