"""plan --validate's expert-parallel cases (planner/validate.py): the bare model whose activations are measured runs
its MoE layers over the expert group as training does (parallel/expert/install.py), with FlexMoE's copy slots
(parallel.expert_replicas) all filled, the bound the count takes (memory/moe_counts.py copy_slot_bytes), and
the rows each rank receives are read from the calls' counts.

A prediction is for the most loaded rank at a receive skew (the plan's --expert-skew); routing in a measured
step has its own skew, which no setting chooses. So the case's activations are compared on the rank that
received the most rows against the prediction at the skew it measured (`received_skews`), and the plan's figure
at the planned skew is reported beside it (an upper bound of the run's while its routing stays within it).
Under hierarchical dispatch (parallel.expert_ranks_per_node) the experts' counts are the node's pairs, not the
group's routing: the rows of each level are recorded instead (planner/validate_hier.py)."""

from __future__ import annotations

from ..memory.hier_counts import hierarchical
from ..models.moe import moe_layers
from ..parallel.expert.install import use_expert_parallel
from ..parallel.expert.placement import Placement
from .validate_hier import record_routes


def every_slot_filled(experts: int, ep: int, replicas: int) -> Placement:
    """Each rank's copy slots hold the first `replicas` experts of the next rank, half their rows each: every slot
    filled, so every rank receives as many copies as it has slots (the count's case)."""
    local = experts // ep
    slots, holders = [], [[] for _ in range(experts)]
    for q in range(ep):
        owner = (q + 1) % ep
        copied = [owner * local + j for j in range(replicas)]
        slots.append(tuple(range(q * local, (q + 1) * local)) + tuple(copied))
        for j, e in enumerate(copied):
            holders[e].append((q, local + j, 0.5))
    full = tuple(((e // local, e % local, 0.5 if holders[e] else 1.0), *holders[e]) for e in range(experts))
    return Placement(ep, local, replicas, tuple(slots), full)


def install_expert_parallel(bare, cfg, rt) -> dict[int, list[int]]:
    """Expert parallelism on the bare model of a case with parallel.expert > 1 (before its memory policy is
    applied), its copy slots filled; returns the dict each MoE layer's first call records its rows per expert
    into ({} and nothing installed at expert 1); under hierarchical dispatch, its rows per level instead
    (validate_hier.record_routes)."""
    if rt.dims.expert <= 1:
        return {}
    ranks_per_node = cfg.parallel.expert_ranks_per_node
    dispatcher = use_expert_parallel(bare, rt.dims.build_expert_mesh("cpu"), ranks_per_node=ranks_per_node)
    if hierarchical(rt.dims.expert, ranks_per_node):
        return record_routes(moe_layers(bare), dispatcher)
    replicas = cfg.parallel.expert_replicas
    placement = every_slot_filled(cfg.model.moe_experts, rt.dims.expert, replicas) if replicas else None
    first: dict[int, list[int]] = {}

    def seen(i):
        def hook(mod, inputs, out):
            first.setdefault(i, inputs[1].tolist())
        return hook
    for i, layer in enumerate(moe_layers(bare)):
        layer.experts.placement = placement
        layer.experts.register_forward_hook(seen(i))
    return first


def received_skews(counts: list[dict], experts: int, ep: int, replicas: int) -> list[float]:
    """Each expert-group rank's receive skew over the MoE layers' first calls: the rows it received (its slots'
    rows from every rank of the group, the filled placement's cut) over its own routed rows (tokens x top_k: the
    even share),
    `counts[rank]` {layer: rows per expert} (install_expert_parallel's). Ranks in group order: ep of them."""
    placement = every_slot_filled(experts, ep, replicas) if replicas else Placement.static(experts, ep)
    slots = placement.slots
    skews = []
    for q in range(ep):
        received = own = 0
        for layer in counts[q]:
            own += sum(counts[q][layer])
            received += sum(sum(placement.slot_counts(counts[r][layer])[q * slots:(q + 1) * slots])
                            for r in range(ep))
        skews.append(received / own if own else 1.0)
    return skews
