"""What FlexMoE's copies of hot experts (parallel.expert_replicas, parallel/expert/placement.py) buy and cost a plan
under --expert-skew: the receive skew left on the most loaded rank, and the copies' weights over the links.

Memory needs nothing here: a copies plan's shape carries MeshShape.expert_replicas, which the activation count takes
exactly (memory/moe_counts.py copy_slot_bytes, every slot filled: the bound), at the planned skew itself, not the
relieved one: the first parallel.expert_placement_window steps run the static placement, and a placement planned
from past steps meets any shift of routing at up to the full skew.

Time, from the code:
- load: the placer's own policy (`plan_placement`, a greedy water-filling with 5% tolerance) run on a load of the
  planned skew `skewed_load`: the most loaded rank of the group receives skew x an even share, spread evenly over
  its experts (each copy slot then takes at most one of them: the least relief per slot, so a bound on what copies
  buy), the other ranks the rest evenly. Its predicted max / mean after the copies is the skew the rank is timed
  at (the expert all-to-all and the straggler's GEMMs, costs/timing.py exposed_expert_seconds);
- bytes: a copy is not state; every layer call fetches the copied experts' weights from their owner (an
  all-to-all, `_fetch_copies`) and the backward of that fetch returns their gradients, and a call recomputed in
  backward fetches once more (placement.py's cost bound). The load above has every copy on the hot rank's
  experts, so that rank sends every copy's 3 x dim x expert_dim values per fetch and receives as many gradients:
  `copy_bytes`, timed over the expert group's links like the rows' all-to-alls (blocking: the copy GEMMs wait for
  them). The placements themselves move nothing (every rank derives them from the same router counts).
Under even routing (skew 1) copies relieve nothing and cost their fetches, so they are never better.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import ModelConfig
from ..costs.hardware import Hardware
from ..costs.shape import MeshShape, group_is_intra_node
from ..costs.timing import link_bandwidth
from ..errors import ConfigError
from ..memory.moe_counts import moe_calls
from ..memory.policy import MemoryPolicy


@dataclass(frozen=True)
class CopyRelief:
    skew: float    # the most loaded rank's routed rows over an even share, after the copies
    copies: int    # copy slots the placer fills in one MoE layer (all of the hot rank's experts)


def skewed_load(experts: int, expert: int, skew: float) -> list[float]:
    """Rows per expert (an even share per rank = 1) with rank 0 at `skew` x its share, spread evenly over its
    experts, and the other ranks sharing the rest evenly (the planner's skew names only the most loaded rank)."""
    local = experts // expert
    hot = skew / local
    cool = (expert - skew) / ((expert - 1) * local)
    return [hot if e < local else cool for e in range(experts)]


@functools.lru_cache(maxsize=256)
def copy_relief(experts: int, expert: int, replicas: int, skew: float) -> CopyRelief:
    """The skew left after the placer's copies with `replicas` slots per rank under `skew` (<= the degree's
    max_expert_skew), and the copies it makes: plan_placement's own prediction on `skewed_load`."""
    if expert <= 1 or replicas <= 0 or skew <= 1.0:
        return CopyRelief(max(skew, 1.0), 0)
    from ..parallel.expert.placement import plan_placement  # (torch: loaded by the planner already)

    placement = plan_placement(skewed_load(experts, expert, skew), expert, replicas)
    return CopyRelief(min(placement.predicted["max_over_mean_after"], skew), placement.copies)


def copy_fetches(m: ModelConfig, policy: MemoryPolicy, tokens: int) -> int:
    """Transfers of the copies' weights (or their gradients) per micro-batch, over every MoE layer: each call of
    the layer (a memory policy's pieces, memory/moe_counts.py moe_calls) fetches them in forward and returns their
    gradients in backward; a recomputed call fetches them once more."""
    offloaded = max(0, m.layers - policy.offload_skip_last) if policy.offload_fraction > 0 else 0
    fetches = 0
    for i in m.moe_layer_ids:
        calls = moe_calls(policy.recompute, i < offloaded, tokens, policy)
        fetches += sum(2 + (not stored) for _, stored in calls)
    return fetches


def copy_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tokens: int, skew: float,
               elem: int) -> float:
    """Bytes over the hot rank's links per micro-batch for its experts' copies (the module docstring): every
    fetch carries each copy's w1, w3, w2 at `elem` bytes a value (the gathered weights' dtype)."""
    relief = copy_relief(m.moe_experts, shape.expert, shape.expert_replicas, skew)
    if not relief.copies:
        return 0.0
    one = 3 * m.dim * m.resolved_expert_dim * elem
    return copy_fetches(m, policy, tokens) * relief.copies * one


def copy_seconds(nbytes: float, shape: MeshShape, hw: Hardware, gpus_per_node: int) -> float:
    """Seconds of `nbytes` of copies over the expert group's links (all-to-alls, as the rows': blocking)."""
    if not nbytes:
        return 0.0
    intra = group_is_intra_node(shape, "expert", gpus_per_node)
    return nbytes / (link_bandwidth(hw, intra) * hw.all_to_all_efficiency)


def replica_counts(req, expert: int) -> tuple[int, ...]:
    """The request's copy slots per rank (Request.expert_replicas) that a layout of expert degree `expert` can
    carry: 0 alone without a group (config rules: copies need expert > 1), and no more than a rank can fill (one
    copy of each expert it does not own: config/inert_options.py)."""
    if expert <= 1:
        return (0,) if 0 in req.expert_replicas else ()
    usable = req.model.moe_experts - req.model.moe_experts // expert
    return tuple(r for r in req.expert_replicas if r <= usable)


def check_expert_replicas(m: ModelConfig, replicas: tuple[int, ...], degrees: tuple[int, ...]) -> None:
    """--expert-replicas (or parallel.expert_replicas given to the plan): integers >= 0, copies only for a MoE
    model with an expert-parallel degree > 1 to try."""
    if not replicas or min(replicas) < 0:
        raise ConfigError(f"--expert-replicas takes copy slots per rank >= 0, e.g. 0,1,2; got {replicas}.")
    if max(replicas) and not (m.is_moe and max(degrees) > 1):
        raise ConfigError(f"copy slots ({max(replicas)}: --expert-replicas or parallel.expert_replicas) copy hot "
                          f"experts within an expert-parallel group, but the plan tries no expert degree > 1 "
                          f"({'degrees ' + ','.join(map(str, degrees)) if m.is_moe else 'a dense model'}): give "
                          f"--expert with a degree > 1, or drop the copies.")
    most = max((m.moe_experts - m.moe_experts // x for x in degrees if x > 1), default=0)
    if max(replicas) and min(r for r in replicas if r) > most:
        raise ConfigError(f"copy slots {','.join(map(str, replicas))} per rank: a rank holds at most one copy of each "
                          f"expert it does not own, {most} at the expert degrees tried ({','.join(map(str, degrees))})"
                          f"; give at most {most}.")
