"""Communication bytes of one candidate's optimizer step, per rank and mesh dim (planner/cost.py's `estimate` puts
them together with the memory and the time): every layer's distributed attention in every micro-batch (the forward
again under full recomputation: parallel/context/volumes.py, the closed forms comm.py's counters are tested to
equal; documents cost no bytes), FSDP's (ZeRO++ as configured), CO2's outer all-reduce (its share per step), a MoE
model's router statistics' all-reduce over every rank (dim "router", each micro-batch: planner/expert_levels.py
router_sum_bytes) and, under expert parallelism, the MoE layers' all-to-alls (even routing; hierarchical
dispatch's per link level: costs/hier_bytes.py)."""

from __future__ import annotations

from ..config import ModelConfig
from ..config.per_model import per_model
from ..costs.hier_bytes import hier_expert_bytes
from ..costs.model_states import fsdp_carried_params
from ..costs.shape import MeshShape
from ..memory.hier_counts import hierarchical
from ..memory.moe_counts import moe_forward_runs
from ..memory.policy import MemoryPolicy
from ..parallel.context.volumes import ZeroPP, attention_bytes, expert_bytes, fsdp_bytes_per_step
from .expert_copies import copy_bytes, copy_relief
from .expert_levels import router_sum_bytes
from .slow_links import co2_outer_bytes


def attention_call_bytes(m: ModelConfig, seq_len: int, micro_batch: int, shape: MeshShape,
                         dtype_bytes: int) -> tuple[dict, dict]:
    """Bytes of one layer's distributed attention: (forward + backward, the forward alone, which
    full recomputation runs again). No docs=: that would be document ids gathered without a sequence
    layout; the training loop always plans one on the host (parallel/context/shares.py local_batch), so documents
    cost no bytes."""
    kw = {"seq": seq_len, "batch": micro_batch, "heads": m.heads, "kv_heads": m.kv_heads,
          "head_dim": m.resolved_head_dim, "head": shape.head, "ctx": shape.ctx, "elem": dtype_bytes}
    return attention_bytes(**kw), attention_bytes(**kw, backward=False)


def comm_bytes_per_step(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, per_call: dict, refwd: dict,
                        grad_accum: int, gather_bytes: int, tokens: int = 0,
                        expert_skew: float = 1.0) -> dict[str, dict[str, float]]:
    """{dim: {label: bytes}} one rank sends per optimizer step: every layer's attention in every
    micro-batch (the forward again under full recomputation), FSDP's, a MoE model's router statistics' all-reduce
    ("router": until 2026-12-07 left out, 316 B a step for debug-moe on 2 ranks), and under expert parallelism
    the MoE layers' all-to-alls of the rank's `tokens` per micro-batch (even routing); with FlexMoE's copies
    (shape.expert_replicas) what the hot rank moves for them at `expert_skew` (planner/expert_copies.py); under
    hierarchical dispatch (shape.expert_ranks_per_node) its two levels as the dims "expert_node" and "expert_local"
    (the comm counters' names) in place of "expert"."""
    comm: dict[str, dict[str, float]] = {}
    for dim, labels in per_call.items():
        for label, nbytes in labels.items():
            total = nbytes + (refwd[dim].get(label, 0) if policy.recompute == "full" else 0)
            comm.setdefault(dim, {})[label] = total * m.layers * grad_accum
    pc = fsdp_carried_params(m, shape)  # FSDP2's padded tensors: what its collectives carry
    zero_pp = ZeroPP(frozenset(p for p in shape.zero_pp.split(",") if p), shape.quant_block, node=shape.node,
                     hpz=shape.hpz_ranks)
    fsdp = fsdp_bytes_per_step(pc["total"], pc["root"], shape, grad_accum, gather_bytes, policy.grad_sync,
                               expert_params=pc["experts"], replicas_sync=shape.data_parallel != "co2",
                               zero_pp=zero_pp)  # what ZeRO++ sends (parallel.zero_pp_block), not plain FSDP's
    if fsdp:  # {} on one rank
        comm["fsdp"] = fsdp
    if shape.data_parallel == "co2":  # a round's outer all-reduce, its share per step
        comm["co2"] = {"co2_outer": co2_outer_bytes(m, shape) / shape.local_steps}
    router = router_sum_bytes(m, shape.world)
    if router:  # a MoE model's router statistics, summed over every rank after each micro-batch's forward
        comm["router"] = {"router": float(router * grad_accum)}
    comm.update(expert_step_bytes(m, shape, policy, tokens, grad_accum, gather_bytes, expert_skew))
    return comm


def expert_step_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tokens: int, grad_accum: int,
                      gather_bytes: int, expert_skew: float = 1.0) -> dict[str, dict[str, float]]:
    """comm_bytes_per_step's expert dims alone ({} without expert parallelism): "expert" (with FlexMoE's copies'
    labels), or under hierarchical dispatch "expert_node" and "expert_local". The search's lower bound of a step
    (planner/step_bound.py) times these very bytes; the policy enters them only through its MoE forward runs."""
    if hierarchical(shape.expert, shape.expert_ranks_per_node) and m.is_moe:
        return {dim: {label: nbytes * grad_accum for label, nbytes in labels.items()}
                for dim, labels in hier_layer_bytes(m, shape, policy, tokens, gather_bytes).items()}
    expert = expert_layer_bytes(m, shape, policy, tokens, gather_bytes)
    if expert and shape.expert_replicas:
        expert.update(copy_layer_bytes(m, shape, policy, tokens, expert_skew, gather_bytes, expert["expert_counts"]))
    return {"expert": {label: nbytes * grad_accum for label, nbytes in expert.items()}} if expert else {}


def expert_layer_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tokens: int,
                       elem: int) -> dict[str, float]:
    """The expert all-to-alls of every MoE layer in one micro-batch of `tokens` rank tokens, routing
    even ({} without expert parallelism)."""
    if shape.expert == 1 or not m.is_moe:
        return {}
    n = len(m.moe_layer_ids)
    per_layer = expert_bytes(tokens=tokens, top_k=m.moe_top_k, experts=m.moe_experts, dim=m.dim,
                             expert=shape.expert, elem=elem, forwards=_forward_runs(m, tokens, policy) / n)
    return {label: nbytes * n for label, nbytes in per_layer.items()}


def hier_layer_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tokens: int,
                     elem: int) -> dict[str, dict[str, float]]:
    """expert_layer_bytes under hierarchical dispatch: {dim: {label: bytes}} of every MoE layer in one
    micro-batch, per link level (costs/hier_bytes.py), routing even."""
    n = len(m.moe_layer_ids)
    per_layer = hier_expert_bytes(tokens=tokens, m=m, expert=shape.expert, ranks_per_node=shape.expert_ranks_per_node,
                                  elem=elem, forwards=_forward_runs(m, tokens, policy) / n)
    return {dim: {label: nbytes * n for label, nbytes in labels.items()} for dim, labels in per_layer.items()}


@per_model
def _forward_runs(m: ModelConfig, tokens: int, policy: MemoryPolicy) -> float:
    """moe_forward_runs, remembered: a function of its arguments alone, which the timed candidates of a search
    repeat (a loop over every MoE layer each time)."""
    return moe_forward_runs(m, tokens, policy)


def copy_layer_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tokens: int, skew: float, elem: int,
                     counts: float) -> dict[str, float]:
    """FlexMoE's copies in one micro-batch: "expert_copies", their weights and gradients over the hot rank's links
    (expert_copies.copy_bytes), and "expert_counts" (`counts`: expert_layer_bytes') per slot once a placement has
    copies: each rank's E / expert experts and its `replicas` slots (dispatch.py's counts by (rank, slot))."""
    if not copy_relief(m.moe_experts, shape.expert, shape.expert_replicas, skew).copies:
        return {}
    local = m.moe_experts // shape.expert
    return {"expert_counts": counts * (local + shape.expert_replicas) / local,
            "expert_copies": copy_bytes(m, shape, policy, tokens, skew, elem)}
