"""A candidate's figures that follow from its activations alone (planner/cost.py's footprint splits into these and
the model states): the saved activations and the backward transient of one rank, the micro-batch's FLOPs and
compute seconds, and the offloaded bytes in host memory. The search (planner/candidate_cache.py) makes them once
per activation group, policy and dtype and shares them between the candidates that differ elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..costs.hardware import Hardware
from ..costs.host_bytes import head_grad_bytes, offloaded_host_bytes
from ..costs.shape import MeshShape
from ..costs.timing import Flops, compute_seconds, micro_batch_flops
from ..memory.accounting import ActivationEstimate, activation_dtype, estimate_activations
from ..memory.core_transients import attention_offload_host_and_traffic
from ..memory.expert_transients import expert_skew_transient_bytes, shared_overlap_transient_bytes
from ..memory.hier_transients import hier_transient_bytes
from ..memory.policy import MemoryPolicy
from ..memory.transients import transient_bytes


def rank_activations(m: ModelConfig, seq_len: int, micro_batch: int, shape: MeshShape, policy: MemoryPolicy,
                     dtype_bytes: int, docs: bool, expert_skew: float = 1.0,
                     autocast: bool = False, head_grad: float = 0.0) -> tuple[ActivationEstimate, float]:
    """(saved activations, transient bytes on top of them) of one rank under `shape` and `policy`;
    under expert parallelism, of the most loaded rank when it receives `expert_skew` x its share of
    the routed rows (memory.moe_counts.expert_rows), with its FlexMoE copy slots (shape.expert_replicas, all
    filled: memory.moe_counts.copy_slot_bytes) and its hierarchical dispatch (shape.expert_ranks_per_node:
    memory/hier_counts.py). dtype_bytes, autocast: activation_dtype's."""
    acts = estimate_activations(m, seq_len, micro_batch, head=shape.head, ctx=shape.ctx, policy=policy,
                                dtype_bytes=dtype_bytes, docs=docs, expert=shape.expert, expert_skew=expert_skew,
                                autocast=autocast, expert_replicas=shape.expert_replicas,
                                expert_ranks_per_node=shape.expert_ranks_per_node)
    return acts, rank_transient(m, seq_len, micro_batch, shape, policy, dtype_bytes, docs, acts, expert_skew,
                                autocast=autocast, head_grad=head_grad)


def rank_transient(m: ModelConfig, seq_len: int, micro_batch: int, shape: MeshShape, policy: MemoryPolicy,
                   dtype_bytes: int, docs: bool, acts: ActivationEstimate, expert_skew: float = 1.0,
                   autocast: bool = False, head_grad: float = 0.0) -> float:
    """rank_activations' transient bytes, given its activations: of the shape only head, ctx, the Double-Ring
    window, the expert degree and its hierarchical dispatch (memory/hier_transients.py) are read (the activations
    themselves do not depend on the window).
    `autocast`: bf16 autocast over fp32 weights (activation_dtype's weight copies; transient_bytes); `head_grad`:
    the tier's bytes in the LM head's backward alone (costs/host_bytes.py head_grad_bytes)."""
    transient = transient_bytes(m, seq_len, micro_batch, head=shape.head, ctx=shape.ctx, window=shape.window,
                                policy=policy, dtype_bytes=dtype_bytes, docs=docs, acts=acts, autocast=autocast,
                                head_grad=head_grad)
    return (transient + expert_skew_transient_bytes(m, acts.tokens, shape.expert, expert_skew, policy, dtype_bytes)
            + shared_overlap_transient_bytes(m, acts.tokens, shape.expert, policy, dtype_bytes, autocast)
            + hier_transient_bytes(m, acts.tokens, shape.expert, shape.expert_ranks_per_node, policy, dtype_bytes,
                                   expert_skew, autocast))


@dataclass(frozen=True)
class ActivationCosts:
    """footprint's figures that follow from the activations alone. `activation_costs` reads of the shape only
    head, ctx, window, expert, expert_replicas and (for the activation dtype, activation_dtype) the world size,
    of the policy every field but grad_sync (no activation, FLOP or offloaded byte depends on it), of the tier only the
    activation dtype: the planner makes one per those and shares it between dp splits, placements, ZeRO++ and
    co2 variants, tiers and gradient syncs."""
    acts: ActivationEstimate
    transient: float
    tokens: int                        # per rank per micro-batch
    work: float                        # doc_work as applied
    flops: Flops
    compute: float                     # seconds per micro-batch
    attn_traffic: float
    acts_host: float                   # offloaded activations in one rank's host memory (pinned: as locked)
    attn_host: float                   # the attention core's offloaded state in one rank's host memory


def activation_costs(m: ModelConfig, hw: Hardware, shape: MeshShape, policy: MemoryPolicy, *, seq_len: int,
                     micro_batch: int, doc_mask: bool, doc_work: float, acts: ActivationEstimate | None,
                     transient: float | None, expert_skew: float, model_states: str) -> ActivationCosts:
    """ActivationCosts of a candidate (footprint's arguments)."""
    if not 0 < doc_work <= 1:
        raise ValueError(f"doc_work must be in (0, 1], got {doc_work}")
    work = doc_work if doc_mask else 1.0
    e = hw.dtype_bytes  # activations, and parameters gathered in the compute dtype (bf16 on GPU, fp32 on CPU)
    # (one process off the host tier: bf16 autocast over fp32 weights)
    act_e, copies = activation_dtype(e == 2, shape.world, model_states)
    if acts is None or transient is None:
        acts, transient = rank_activations(m, seq_len, micro_batch, shape, policy, act_e, doc_mask, expert_skew,
                                           autocast=copies, head_grad=head_grad_bytes(m, shape, model_states))
    tokens = micro_batch * seq_len // shape.sequence_degree  # per rank per micro-batch
    flops = micro_batch_flops(m, tokens, seq_len, policy, acts, work)
    attn_host, attn_traffic = attention_offload_host_and_traffic(m, seq_len, micro_batch, head=shape.head,
                                                                 ctx=shape.ctx, policy=policy, dtype_bytes=e,
                                                                 work=work)
    acts_host, attn_host = offloaded_host_bytes(m, shape, policy, seq_len=seq_len, micro_batch=micro_batch,
                                                act_bytes=act_e, dtype_bytes=e, activations=acts.total_host,
                                                attention=attn_host, docs=doc_mask, pinned=not hw.is_cpu,
                                                expert_skew=expert_skew, autocast=copies)
    return ActivationCosts(acts, transient, tokens, work, flops, compute_seconds(flops, hw), attn_traffic, acts_host,
                           attn_host)
