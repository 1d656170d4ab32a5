"""Search: price every candidate of a request (planner/request.py), prune, rank by predicted step time.

Branches are cut as early as their cause is known:

- a (head, ctx, dp_replicate) whose model states alone exceed GPU memory skips every policy;
- activation and transient estimates (activation_costs.rank_activations) are computed once per (head, ctx,
  micro-batch, policy) and reused for every dp split, window and placement;
- a candidate takes the first model-state tier that fits, and its memory (cost.footprint) decides
  whether it fits before anything about its time is computed;
- a candidate never faster than a twin that fits the layout's first tier, holding no fewer GiB, is skipped
  (`dominated`: expert pieces without activation offload, a block or attention chunk spanning all the tokens).

`plan(...)` returns a `PlanResult`: every candidate that fits, ranked by step time and timed as the
ranking is read (planner/ranking.py: its time is predicted only where it can come before the plans
read), and, when nothing fits, every candidate by memory and what would fit (`suggest`): more GPUs,
offload, a shorter sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..costs.host_bytes import TIERS, device_state_bytes
from ..costs.shape import MeshShape
from ..memory.policy import MemoryPolicy
from ..progress import Phase, phase
from .candidate_cache import (
    Caches,
    Layout,
    Shared,
    candidate_costs,
    device_total,
    may_fit,
    policy_indices,
    tier_costs,
)
from .cost import Estimate, Footprint, footprint_of, gib_text, timed
from .ranking import Ranking
from .request import (
    _POLICY_ORDER,
    OFFLOAD_FRACTIONS,
    ZERO_PP_ORDER,
    Request,
    candidate_shapes,
    divisors,
    head_degree_ok,
    policies,
)
from .step_bound import bound_keys, step_text


@dataclass
class PlanResult:
    request: Request
    # by predicted step time: a Ranking of the plans that fit (timed as read), or, when none fits,
    # a list of every candidate by memory
    ranked: Sequence[Estimate]
    evaluated: int                       # candidates (layout, policy, micro-batch, tier) whose memory was predicted
    search_seconds: float
    suggestions: list[str] = field(default_factory=list)
    co2_plans: Sequence[Estimate] = field(default_factory=list)  # feasible co2 plans held out: co2 not allowed

    @property
    def feasible(self) -> Sequence[Estimate]:
        if isinstance(self.ranked, Ranking):  # every candidate of a Ranking fits
            return self.ranked
        return [e for e in self.ranked if e.feasible]

    @property
    def timed(self) -> int:
        """Candidates whose time was predicted so far."""
        return sum(r.timed if isinstance(r, Ranking) else len(r) for r in (self.ranked, self.co2_plans))

    @property
    def seconds(self) -> float:
        """The search and the timing of every plan read so far."""
        return self.search_seconds + sum(r.seconds for r in (self.ranked, self.co2_plans) if isinstance(r, Ranking))

    @property
    def best(self) -> Estimate | None:
        f = self.feasible
        return f[0] if f else None


def _sort_key(e: Estimate):
    """Feasible plans by step time as shown (ties: device states, plain FSDP transfers, simpler policy,
    less memory); infeasible ones by memory.

    The key is the step time the table prints, not the unrounded one nor a tolerance band: a band
    (say "within 0.5% is a tie, prefer the simpler policy") ranks 0.08921 s above 0.08918 s, which
    reads as a wrong order; times equal to the shown digits are the only ties."""
    p = e.policy
    if not e.feasible:
        return (1, e.memory["total"] + e.host_per_node, e.step_s)
    s = e.mesh_shape  # ties: sync before co2 (convergence), hpZ on the node before a group (less memory)
    # (fewer FlexMoE copy slots first: a tie buys nothing with their memory; the flat exchange before the
    # hierarchical one: it adds with no atomics, models/moe_dispatch.py)
    return (0, float(step_text(e.step_s)), TIERS.index(e.model_states), s.expert_replicas, s.expert_ranks_per_node,
            ZERO_PP_ORDER.index(s.zero_pp), s.data_parallel == "co2", s.hpz_ranks, _POLICY_ORDER[p.recompute],
            p.offload_fraction, round(e.memory["total"] / 2**30),
            p.loss_chunk, p.block_chunk != 0, -p.block_chunk, p.attention_chunk != 0, p.attention_offload,
            e.mesh_shape.dp_replicate, e.mesh_shape.window, p.expert_chunk, e.mesh_shape.expert)


def held(req: Request, shape: MeshShape) -> bool:
    """co2 plans are held out of the ranking (reported beside it) unless the request allows co2."""
    return shape.data_parallel == "co2" and "co2" not in req.allow


def plan(req: Request, keep_infeasible: bool = True, explain: bool = True) -> PlanResult:
    """Every candidate that fits, ranked by predicted step time (a Ranking: timed as read; the best is
    timed here). keep_infeasible: when nothing fits, every candidate ranked by memory (all timed), for
    the table and the suggestions. A progress phase (progress.py): a search of millions of candidates
    (experts, micro-batches, tiers and offloads to try) takes minutes, said while it runs, in mesh shapes."""
    with phase(f"plan: searching the candidates on {req.gpus:,} GPUs", done_line=False) as progress:
        return _plan(req, keep_infeasible, explain, progress)


def _plan(req: Request, keep_infeasible: bool, explain: bool, progress: Phase) -> PlanResult:
    t0 = time.perf_counter()
    caches = Caches()
    found, evaluated = _evaluate(req, False, caches, progress=progress)

    def complete(fp: Footprint) -> Estimate:
        return timed(req.model, req.hardware, fp, seq_len=req.seq_len, global_batch=req.global_batch,
                     gpus_per_node=req.gpus_per_node, expert_skew=req.expert_skew)

    if found or not keep_infeasible:
        bound = bound_keys(req, found)
        split: tuple[list[Footprint], list[Footprint]] = ([], [])  # (ranked, held out), each in found's order
        if "co2" in req.allow:  # (held() of every candidate is False)
            split[0].extend(found)
        else:
            for fp in found:
                split[fp.mesh_shape.data_parallel == "co2"].append(fp)
        ranked, held_out = (Ranking(part, complete, _sort_key, bound) for part in split)
        ranked[:1]  # the best, within the search's seconds
    else:
        found, more = _evaluate(req, True, caches, progress=progress)
        evaluated += more
        every = sorted(map(complete, found), key=_sort_key)
        ranked, held_out = [e for e in every if not held(req, e.mesh_shape)], []
    res = PlanResult(req, ranked, evaluated, time.perf_counter() - t0, co2_plans=held_out)
    if explain and not res.feasible:
        res.suggestions = suggest(req, res, caches.shared)
    return res


def _evaluate(req: Request, keep_infeasible: bool, caches: Caches, first_only: bool = False,
              progress: Phase | None = None) -> tuple[list[Footprint], int]:
    """Every candidate's footprint in its first tier that fits (keep_infeasible: every tier's, when none
    does); first_only: stop at the first that fits (whether any does). caches: the request's Caches.
    progress: the phase that counts the mesh shapes done (plan's), if any."""
    hw, m = req.hardware, req.model
    shapes = candidate_shapes(req)
    progress = progress if progress is not None else Phase("")  # (one nobody reads)
    progress.expect(len(shapes), "mesh shapes")
    pols = policies(req)
    # every policy in both gradient-sync variants, in policy order, made once (not per shape and micro-batch:
    # tens of thousands of dataclass copies), each with its index (of its grad_sync step variant) and grad_sync
    by_sync = {g: [dataclasses.replace(p, grad_sync=g) for p in pols] for g in ("step", "micro_batch")}
    index, *twins = policy_indices(by_sync["step"])
    in_order = {syncs: [(i, g, by_sync[g][i]) for i in range(len(pols)) for g in syncs]
                for syncs in (("step",), ("step", "micro_batch"))}
    results: list[Footprint] = []
    evaluated = 0
    for done, shape in enumerate(shapes):
        progress.done = done
        # model states alone, in each tier: prune every policy of this shape if none of them fits
        static = {t: sum(device_state_bytes(m, shape, t, hw.dtype_bytes).values()) for t in req.model_states}
        if min(static.values()) > hw.usable_memory_bytes and not keep_infeasible:
            continue
        dp_share = req.global_batch // shape.dp if req.global_batch % shape.dp == 0 else 0
        for mb in req.micro_batches:
            if not dp_share or dp_share % mb:
                continue
            tokens = mb * req.seq_len // shape.sequence_degree
            # with accumulation, reducing per micro-batch trades traffic for the unsharded gradients
            syncs = ("step", "micro_batch") if dp_share // mb > 1 and shape.world > 1 else ("step",)
            layout = Layout(req, shape, mb, static, caches)
            order = (in_order[syncs] if keep_infeasible else
                     [(i, g, by_sync[g][i]) for i in may_fit(req, layout, index, by_sync["step"], caches)
                      for g in syncs])
            # (policy, grad_sync) that fit the layout's first tier, or are no faster than one that does: the GiB
            # (_sort_key's) of the one that fits
            first_fit: dict[tuple[int, str], int] = {}
            for i, g, pol in order:
                gib = dominated(pol, i, shape.head, tokens, twins, g, first_fit)
                if gib is not None and _first_tier_gib(req, layout, pol, index[i], by_sync["step"][i], caches) >= gib:
                    first_fit[index[i], g] = gib  # (what it would rule out, its twin rules out)
                    continue
                kept, n = _tiers(req, layout, pol, index[i], by_sync["step"][i], caches, keep_infeasible)
                evaluated += n
                if kept and kept[-1].feasible and kept[-1].model_states == layout.tiers[0]:
                    first_fit[index[i], g] = _gib(kept[-1].memory["total"])
                results += kept
                if first_only and any(not held(req, fp.mesh_shape) for fp in kept):
                    return results, evaluated
    return results, evaluated


def dominated(pol: MemoryPolicy, i: int, head: int, tokens: int, twins: list[list[int | None]], g: str,
              first_fit: dict) -> int | None:
    """The GiB (as _sort_key rounds them) of a twin that fits the layout's first tier (first_fit) and that the
    candidate is never faster than, or None: chunks only add recomputation to the same tier's candidate, and a later
    tier only adds time. Its twins (policy_indices): the experts' rows whole (expert_chunk 0) where no activations
    are offloaded (expert pieces offload fewer bytes: qwen3-30b-a3b on 8 x H100 at 16K, selective+off0.25 in pieces
    takes 1.858 s, whole rows 2.180 s), whole blocks where one block chunk spans the rank's tokens, the whole core
    where one attention chunk spans the core's (after the head all-to-all). A chunk that spans the tokens is still a
    candidate of its own (memory/apply_policy.py runs it in parts; it holds less than whole blocks): until
    2026-12-07 it was never tried, and a request it alone fits was told no plan fits
    (tests/unit/test_plansearch_fuzz118.py). The search skips it only where it holds no fewer GiB than the twin
    (_sort_key breaks a tie of step times by them; tests/unit/test_review118d.py)."""
    expert, block, core = twins[0][i], twins[1][i], twins[2][i]
    if pol.expert_chunk and not pol.offload_fraction and (expert, g) in first_fit:
        return first_fit[expert, g]
    if pol.block_chunk and pol.block_chunk >= tokens:
        return first_fit.get((block, g))
    if pol.attention_chunk and pol.attention_chunk >= tokens * head:
        return first_fit.get((core, g))
    return None


def _gib(total: float) -> int:
    """GiB as _sort_key rounds a plan's memory (a tie of step times goes to fewer)."""
    return round(total / 2**30)


def _first_tier_gib(req: Request, layout: Layout, pol: MemoryPolicy, policy: int, step_pol: MemoryPolicy,
                    caches: Caches) -> int:
    """A candidate's GiB (_gib) in the layout's first tier, from its activations alone (its footprint's total, as
    _tiers checks it), for dominated's twin: in a later tier it comes after the twin whatever it holds."""
    tier = layout.tiers[0]
    entry = layout.rows[tier].get(policy) or tier_costs(req, layout, policy, step_pol, caches, tier)
    return _gib(device_total(req, layout, pol, tier, entry[0], entry[1]))


def _tiers(req: Request, layout: Layout, pol: MemoryPolicy, policy: int, step_pol: MemoryPolicy, caches: Caches,
           keep_infeasible: bool) -> tuple[list[Footprint], int]:
    """One candidate in the first model-state tier that fits, tried in req.model_states' order
    (device, host_optimizer, host): for the same layout, policy and micro-batch a host tier adds
    host-link and host AdamW time to the same compute, so it is never faster than a tier before it
    that fits, and holds no less in host memory. Returns (the footprints kept, the number made):
    with keep_infeasible every tier tried when none fits, else only a feasible one. policy: pol's index,
    step_pol: pol under grad_sync step (tier_costs)."""
    hw, m, shape, made = req.hardware, req.model, layout.shape, []
    usable = layout.usable
    for tier in layout.tiers:
        entry = layout.rows[tier].get(policy) or tier_costs(req, layout, policy, step_pol, caches, tier)
        acts, transient = entry[0], entry[1]
        if not keep_infeasible and (layout.static[tier] + acts.total_device + transient > usable or
                                    device_total(req, layout, pol, tier, acts, transient) > usable):
            continue  # the GPU's memory alone rules it out (estimate's own sum, before its time)
        costs = entry[2] or candidate_costs(req, layout, step_pol, policy, tier, entry, caches)
        fp = footprint_of(m, hw, shape, pol, costs, seq_len=req.seq_len, global_batch=req.global_batch,
                          micro_batch=layout.mb, gpus_per_node=req.gpus_per_node, doc_mask=req.doc_mask,
                          model_states=tier, co2_steps=req.co2_local_steps, settings=req.settings,
                          states=layout.states)
        made.append(fp)
        if fp.feasible:
            return [fp], len(made)
        if fp.host_per_node > hw.usable_host_bytes and not keep_infeasible:
            break  # the tiers after it keep more in host memory, not less
    return (made if keep_infeasible else []), len(made)


def _fits(req: Request, shared: Shared, **changes) -> bool:
    """Whether any candidate of the changed request fits (the search stops at the first)."""
    found, _ = _evaluate(dataclasses.replace(req, **changes), False, Caches(shared), first_only=True)
    return bool(found)


def _host_memory_suggestion(req: Request, res: PlanResult, shared: Shared) -> list[str]:
    """When plans fit the GPU but not the host: the least host memory one of them needs, by part,
    against the hardware's, and the host memory per node that makes the request feasible."""
    hw = req.hardware
    # (only plans the host memory rules out: one refused for another reason, e.g. a CPU run's one-memory peak
    # (cost.memory_problems), was reported as needing host memory the hardware has)
    fit_gpu = [e for e in res.ranked if e.memory["total"] <= hw.usable_memory_bytes and
               e.host_per_node > hw.usable_host_bytes]
    if not fit_gpu or not hw.usable_host_fraction:
        return []
    e = min(fit_gpu, key=lambda e: e.host_per_node)
    ranks = e.host_per_node / e.host["total"] if e.host.get("total") else 1
    parts = ", ".join(f"{k.replace('_', ' ')} {v * ranks / 2**30:.1f}" for k, v in e.host.items()
                      if k != "total" and v * ranks >= 2**30 / 10)
    need = e.host_per_node / hw.usable_host_fraction / 2**30
    text = (f"plans that fit the GPU need host memory the hardware does not have: at least "
            f"{e.host_per_node / 2**30:.1f} GiB per node ({e.mesh_shape.describe()}, {e.policy.describe()}, "
            f"model states {e.model_states}: {parts}) against {hw.usable_host_bytes / 2**30:.1f} GiB usable of "
            f"{hw.host_memory_gib:g}")
    for gib in sorted({math.ceil(need / 16) * 16, math.ceil(need / 64) * 64, 2 ** math.ceil(math.log2(need))}):
        if _fits(req, shared, hardware=hw.replace(host_memory_gib=gib)):
            return [f"{text}; nodes with {gib:,} GiB of host memory (--hw host_memory_gib={gib}) make it feasible"]
    return [text]


def request_error(req: Request) -> str:
    """'' when the request spans candidates, else why it spans none (no layout divides the sequence and the
    batch, or no micro-batch size splits a rank's share): a property of the request, told before any search
    (`longctx plan` printed an empty table, or JSON without plans, and then said that no plan "fits")."""
    shapes = candidate_shapes(req)
    if any((req.global_batch // s.dp) % mb == 0 for s in shapes for mb in req.micro_batches):
        return ""
    return _why_no_candidate(req)


def _why_no_candidate(req: Request) -> str:
    """No candidate at all: the layouts divide the sequence and the batch but no micro-batch size splits
    a rank's share, or no layout divides the sequence."""
    shapes = candidate_shapes(req)
    if shapes:
        shares = sorted({req.global_batch // s.dp for s in shapes})
        return (f"no micro-batch of {', '.join(map(str, req.micro_batches))} divides a data-parallel rank's share "
                f"of the global batch {req.global_batch} (sequences per rank per step: one of {shares}); "
                f"choose --micro-batch among the divisors of those, or a larger --global-batch")
    # the layouts whose data-parallel degree divides the global batch: the sequence must divide over one of them
    units = sorted({2 * h * c for h in divisors(req.gpus) if head_degree_ok(req.model, h)
                    for c in divisors(req.gpus // h) if req.global_batch % (req.gpus // (h * c)) == 0})
    if not units:
        return (f"no layout of {req.gpus} GPUs has a data-parallel degree that divides the global batch "
                f"{req.global_batch}; choose a --global-batch that is a multiple of the data-parallel degrees")
    return (f"no layout of {req.gpus} GPUs divides the sequence"
            + (f" with a data-parallel degree dividing the global batch {req.global_batch}" if
               req.global_batch % req.gpus else "")
            + f": {req.seq_len} tokens must be divisible by "
            f"2 x head x ctx (one of {units[:8]}); choose a sequence length that is a multiple of "
            f"{units[-1]}" + (f", or a multiple of {units[0]} with fewer sequence-parallel ranks" if len(units) > 1
                              else ""))


def suggest(req: Request, res: PlanResult, shared: Shared | None = None) -> list[str]:
    """What would make an infeasible request feasible. shared: the activations plan() computed (Shared)."""
    shared = shared or Shared()
    if not res.ranked:
        return [_why_no_candidate(req)]
    out = []
    least = min(res.ranked, key=lambda e: e.memory["total"])
    out.append(f"the least GPU memory any plan needs is {gib_text(least.memory['total'])} GiB per GPU "
               f"({least.mesh_shape.describe()}, {least.policy.describe()}; "
               f"{gib_text(req.hardware.usable_memory_bytes)} GiB usable)"
               + (f", and then: {'; '.join(least.problems)}" if least.problems else ""))
    if req.hardware.host_memory_gib and req.hardware.usable_host_fraction and not any(
            a > 0 for a in req.offload_fractions):
        with_offload = {"offload_fractions": OFFLOAD_FRACTIONS,
                        "recomputes": tuple(sorted(set(req.recomputes) | {"selective"}))}
        if _fits(req, shared, **with_offload):
            out.append("activation offload (memory.offload_fraction with full or selective recomputation) makes "
                       "it feasible")
        else:
            for factor in (2, 4, 8):
                host = req.hardware.host_memory_gib * factor
                if _fits(req, shared, hardware=req.hardware.replace(host_memory_gib=host), **with_offload):
                    out.append(f"activation offload makes it feasible with {host:,.0f} GiB of host memory per node "
                               f"(--hw host_memory_gib={host:.0f})")
                    break
    host_text = _host_memory_suggestion(req, res, shared)
    out += host_text
    if not host_text and least.host_per_node > req.hardware.usable_host_bytes and req.hardware.host_memory_gib:
        need = least.host_per_node / req.hardware.usable_host_fraction / 2**30
        out.append(f"nodes with >= {need:,.0f} GiB of host memory (--hw host_memory_gib=...) would hold the "
                   f"offloaded activations")
    if (0 not in req.loss_chunks or len(req.loss_chunks) == 1) and _fits(req, shared, loss_chunks=(0, 4096)):
        out.append("a chunked LM head + loss (memory.loss_chunk) makes it feasible")
    g = req.gpus
    for _ in range(6):
        g *= 2
        if g > req.gpus_per_node and g % req.gpus_per_node:
            continue  # not whole nodes: Request would refuse it
        if _fits(req, shared, gpus=g, global_batch=req.global_batch * g // req.gpus):
            out.append(f"{g} GPUs make it feasible")
            break
    seq = req.seq_len
    for _ in range(8):
        seq //= 2
        if seq < 2 * req.gpus and seq < 1024:
            break
        if _fits(req, shared, seq_len=seq):
            out.append(f"a sequence of {seq:,} tokens fits on {req.gpus} GPUs")
            break
    return out
