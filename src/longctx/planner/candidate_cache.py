"""What the planner's search computes once and reuses across its candidates (planner/search.py): a candidate's
activations and backward transient per activation group, policy and dtype; a layout's model-state parts; the
sums that let a search skip policies that fit no tier. Every cache says what its value depends on, which is
why it may be reused: the results are those of computing each candidate from scratch
(tests/unit/test_planner_search_caches.py)."""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import TYPE_CHECKING

from ..costs.host_bytes import device_bytes_with, head_grad_bytes
from ..costs.shape import MeshShape
from ..memory.accounting import activation_dtype, estimate_activations
from ..memory.policy import MemoryPolicy
from .activation_costs import ActivationCosts, activation_costs, rank_transient
from .cost import kept_state_parts

if TYPE_CHECKING:
    from .request import Request


class Shared:
    """Activations and transient bytes shared by the requests one plan() searches (the request, and suggest's
    changed ones: more host memory, offload, loss chunks, GPUs, shorter sequences), keyed by every argument
    they read: the model (by identity: one object in all of them), the sequence, document masks, the expert
    skew, the policy (under grad_sync step: no activation depends on it), the activation dtype and weight copies;
    of the layout, for estimate_activations, head, expert, expert_replicas, expert_ranks_per_node and the rank's
    tokens (micro-batch x sequence / (head x ctx): it reads the micro-batch and ctx only through them,
    tests/unit/test_planner_search_caches.py), for rank_transient head, ctx, window, expert, expert_replicas,
    expert_ranks_per_node, the micro-batch and the tier's head_grad_bytes."""

    def __init__(self):
        self.acts: dict[tuple, object] = {}
        self.transients: dict[tuple, float] = {}


class Caches:
    """What one request's search computes once and reuses (valid for that request only: its keys are indices
    into the request's policy list). costs: by (head, ctx, window, expert, expert_replicas, expert_ranks_per_node,
    micro-batch, activation dtype, weight copies, the tier's head_grad_bytes), a row {policy index: the entry
    [activations, transient bytes (from `shared`), ActivationCosts or None until a candidate needs it]}: nothing
    else of a candidate changes them (not the dp split, the placement, ZeRO++, co2, the tier but through its dtype
    and head_grad_bytes, nor grad_sync); a Layout holds its tiers' rows, so a candidate's entry is one lookup by its
    policy. sums: _sorted_sums. chunked: may_fit's expert-chunked positions of the
    policy list it was made for (that list, the set)."""

    def __init__(self, shared: Shared | None = None):
        self.shared = shared or Shared()
        self.costs: dict[tuple, dict[int, list]] = {}
        self.sums: dict[tuple, tuple[list[float], list[int]]] = {}
        self.chunked: tuple[list[MemoryPolicy] | None, set[int]] = (None, set())
        self.window_free: dict[tuple, ActivationCosts] = {}


def policy_indices(pols: list[MemoryPolicy]) -> tuple[list[int], list[int | None], list[int | None],
                                                     list[int | None]]:
    """(each policy's index, its twins' (None where the request has no such policy): the experts' rows whole
    (expert_chunk 0), whole blocks (block and attention chunks 0, the core's state on the device), the whole core
    (attention chunk 0, on the device); search.dominated), an index being that of the first equal policy: equal
    policies share one, so sets and keys of indices behave as those of the (slower to hash) policies did."""
    first: dict[MemoryPolicy, int] = {}
    for i, p in enumerate(pols):
        first.setdefault(p, i)
    index = [first[p] for p in pols]
    replace = dataclasses.replace
    twin = [first.get(replace(p, expert_chunk=0)) if p.expert_chunk else None for p in pols]
    block = [first.get(replace(p, block_chunk=0, attention_chunk=0, attention_offload=False)) if p.block_chunk
             else None for p in pols]
    core = [first.get(replace(p, attention_chunk=0, attention_offload=False)) if p.attention_chunk else None
            for p in pols]
    return index, twin, block, core


def may_fit(req: Request, layout: Layout, index: list[int], step_pols: list[MemoryPolicy],
            caches: Caches) -> list[int]:
    """The positions in the policy list, ascending, of the policies that may fit the layout in some tier: the
    others fail _tiers' first check (model states + activations + transient > usable) in every tier, so _tiers
    would make nothing of them (no footprint, nothing counted, nothing for first_fit): skipping them changes
    nothing. A policy is skipped only when its activations + transient exceed a tier's room by a margin far
    above any rounding of the two sums (1e-6 of the bytes compared, where rounding is ~1e-16 of them)."""
    usable = req.hardware.usable_memory_bytes
    # (expert-chunked policies are all kept: most are skipped where their unchunked twin fits, before their
    # activations are ever computed, which sorting them would compute; the set is the policy list's, made once)
    if caches.chunked[0] is not step_pols:
        caches.chunked = (step_pols, {i for i, pol in enumerate(step_pols) if pol.expert_chunk})
    out = set(caches.chunked[1])
    for tier in layout.tiers:
        sums, positions = _sorted_sums(req, layout, index, step_pols, caches, tier)
        room = usable - layout.static[tier]
        out.update(positions[:bisect.bisect_right(sums, room + 1e-6 * (abs(usable) + abs(layout.static[tier])))])
    return sorted(out)


def _sorted_sums(req: Request, layout: Layout, index: list[int], step_pols: list[MemoryPolicy], caches: Caches,
                 tier: str) -> tuple[list[float], list[int]]:
    """(activations + transient bytes ascending, the policy positions they belong to) of every policy of the
    layout's activation group (head, ctx, window, expert, micro-batch) under `tier` (its activation dtype and
    head_grad_bytes) but the expert-chunked ones (may_fit keeps them all); a NaN sum as -inf (never skipped: NaN
    fails no comparison). Kept in caches.sums: a function of the group, the dtype and head_grad_bytes alone. (A
    block or attention chunk that spans the group's tokens is summed too: it holds less than whole blocks.)"""
    s, mb = layout.shape, layout.mb
    key = (s.head, s.ctx, s.window, s.expert, s.expert_replicas, s.expert_ranks_per_node, mb, layout.dtypes[tier],
           layout.head_grads[tier])
    if key not in caches.sums:
        pairs = []
        for i, pol in enumerate(step_pols):
            if pol.expert_chunk:
                continue
            acts, transient, _ = tier_costs(req, layout, index[i], pol, caches, tier)
            total = acts.total_device + transient
            pairs.append((total if total == total else -math.inf, i))  # (NaN: never skipped)
        pairs.sort()
        caches.sums[key] = ([t for t, _ in pairs], [i for _, i in pairs])
    return caches.sums[key]


class Layout:
    """One layout and micro-batch of a request, and what every policy of it shares: the tiers tried, each
    tier's activation dtype (activation_dtype: the hardware's dtype, the world size and the tier), its model
    states alone (`static`), `states` (cost.footprint_of's cache of what the tier holds before the
    activations: cost.kept_state_parts), `rows` (each tier's row of caches.costs, its activation group's and
    dtype's), `totals` (device_total's cache) and the GPU's usable bytes."""

    def __init__(self, req: Request, shape: MeshShape, mb: int, static: dict[str, float],
                 caches: Caches | None = None):
        self.shape, self.mb, self.static = shape, mb, static
        self.grad_accum = max(1, req.global_batch // (shape.dp * mb))
        # co2 keeps its outer state beside the weights on the device (config/data_parallel.py)
        self.tiers = (req.model_states if shape.data_parallel != "co2" else
                      ("device",)[:"device" in req.model_states])
        self.dtypes = {t: activation_dtype(req.hardware.dtype_bytes == 2, shape.world, t) for t in self.tiers}
        self.states: dict[tuple, object] = {}
        self.usable = req.hardware.usable_memory_bytes
        costs = {} if caches is None else caches.costs
        group = (shape.head, shape.ctx, shape.window, shape.expert, shape.expert_replicas, shape.expert_ranks_per_node,
                 mb)
        # (and by what the tier holds in the LM head's backward alone: its transient's)
        self.head_grads = {t: head_grad_bytes(req.model, shape, t) for t in self.tiers}
        self.rows = {t: costs.setdefault((*group, *self.dtypes[t], self.head_grads[t]), {}) for t in self.tiers}
        self.totals: dict[tuple, tuple] = {}


def tier_costs(req: Request, layout: Layout, policy: int, step_pol: MemoryPolicy, caches: Caches,
               tier: str) -> list:
    """[activations, transient bytes, ActivationCosts or None] of a candidate under `tier` (policy: its index,
    step_pol: the policy under grad_sync step), from `caches` (Caches: what each entry depends on), through the
    layout's row of it."""
    row = layout.rows[tier]
    entry = row.get(policy)
    if entry is None:
        s, (e, copies) = layout.shape, layout.dtypes[tier]
        m, seq, shared = req.model, req.seq_len, caches.shared
        request_key = (id(m), seq, req.doc_mask, req.expert_skew, step_pol, e, copies)
        acts_key = (*request_key, s.head, layout.mb * seq // s.sequence_degree, s.expert, s.expert_replicas,
                    s.expert_ranks_per_node)
        acts = shared.acts.get(acts_key)
        if acts is None:
            acts = shared.acts[acts_key] = estimate_activations(
                m, seq, layout.mb, head=s.head, ctx=s.ctx, policy=step_pol, dtype_bytes=e, docs=req.doc_mask,
                expert=s.expert, expert_skew=req.expert_skew, autocast=copies, expert_replicas=s.expert_replicas,
                expert_ranks_per_node=s.expert_ranks_per_node)
        head_grad = layout.head_grads[tier]
        transient_key = (*request_key, s.head, s.ctx, s.window, s.expert, s.expert_replicas, s.expert_ranks_per_node,
                         layout.mb, head_grad)
        transient = shared.transients.get(transient_key)
        if transient is None:
            transient = shared.transients[transient_key] = rank_transient(m, seq, layout.mb, s, step_pol, e,
                                                                          req.doc_mask, acts, req.expert_skew,
                                                                          autocast=copies, head_grad=head_grad)
        entry = row[policy] = [acts, transient, None]
    return entry


def device_total(req: Request, layout: Layout, pol: MemoryPolicy, tier: str, acts, transient: float) -> float:
    """The device bytes' "total" of a candidate (costs/host_bytes.py device_bytes_with, as cost.footprint_of sums
    them; its shape before co2 settles its local steps), from the layout's kept state parts (cost.kept_state_parts,
    as footprint_of keeps them).

    Kept in layout.totals by (tier, grad_sync), which fix them: the values device_bytes_with's dict holds before
    the activations, in its order, so the total is sum() of the very sequence its dict sums (parts, activations,
    transient), bit for bit, without the dict. (None where a part were named like one of the two it adds, which
    the dict would overwrite: then the dict itself.)"""
    key = (tier, pol.grad_sync)
    kept = layout.totals.get(key)
    if kept is None:
        parts = kept_state_parts(layout.states, req.model, req.hardware, layout.shape, tier, pol.grad_sync,
                                 layout.grad_accum, seq_len=req.seq_len, micro_batch=layout.mb,
                                 doc_mask=req.doc_mask, settings=req.settings)
        before = dict(parts[0])
        plain = not {"activations", "transient"} & before.keys()
        kept = layout.totals[key] = (tuple(before.values()) if plain else None, parts[0])
    values, before = kept
    if values is None:
        return device_bytes_with(before, acts.total_device, transient)["total"]
    return sum((*values, acts.total_device, transient))


def candidate_costs(req: Request, layout: Layout, step_pol: MemoryPolicy, policy: int, tier: str, entry: list,
                    caches: Caches) -> ActivationCosts:
    """A candidate's ActivationCosts (activation_costs of its entry's activations and transient), kept in the
    entry. Of the shape activation_costs reads, given both, head, ctx and expert (and the world size only
    through the activation dtype): every window of an activation group shares one, but for its transient
    (caches.window_free by head, ctx, expert, micro-batch, policy and dtype)."""
    s = layout.shape
    key = (s.head, s.ctx, s.expert, s.expert_replicas, s.expert_ranks_per_node, layout.mb, policy, *layout.dtypes[tier])
    acts, transient = entry[0], entry[1]
    base = caches.window_free.get(key)
    if base is not None and base.acts is acts:
        costs = dataclasses.replace(base, transient=transient) if base.transient != transient else base
    else:
        costs = caches.window_free[key] = activation_costs(
            req.model, req.hardware, s, step_pol, seq_len=req.seq_len, micro_batch=layout.mb, doc_mask=req.doc_mask,
            doc_work=req.doc_work, acts=acts, transient=transient, expert_skew=req.expert_skew, model_states=tier)
    entry[2] = costs
    return costs
