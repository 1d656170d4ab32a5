"""Search: price every candidate of a request (planner/request.py), prune, rank by predicted step time.

Branches are cut as early as their cause is known:

- a (head, ctx, dp_replicate) whose model states alone exceed GPU memory skips every policy;
- activation and transient estimates (cost.rank_activations) are computed once per (head, ctx,
  micro-batch, policy) and reused for every dp split, window and placement;
- a candidate takes the first model-state tier that fits, and its memory (cost.footprint) decides
  whether it fits before anything about its time is computed.

`plan(...)` returns a `PlanResult`: every candidate that fits, ranked by step time and timed as the
ranking is read (planner/ranking.py: its time is predicted only where it can come before the plans
read), and, when nothing fits, every candidate by memory and what would fit (`suggest`): more GPUs,
offload, a shorter sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..costs.host_bytes import TIERS, device_state_bytes
from ..costs.shape import MeshShape
from ..costs.timing import exposed_fsdp_seconds, predicted_block_forward_seconds
from ..memory.accounting import activation_dtype
from ..memory.policy import MemoryPolicy
from .cost import Estimate, Footprint, footprint, gib_text, memory_bytes, rank_activations, timed
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


def step_text(step_s: float) -> str:
    """A predicted step time as the table shows it (4 significant digits); the ranking sorts by it."""
    return f"{step_s:.4g}"


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
    return (0, float(step_text(e.step_s)), TIERS.index(e.model_states), ZERO_PP_ORDER.index(s.zero_pp),
            s.data_parallel == "co2", s.hpz_ranks, _POLICY_ORDER[p.recompute], p.offload_fraction,
            round(e.memory["total"] / 2**30),
            p.loss_chunk, p.block_chunk != 0, -p.block_chunk, p.attention_chunk != 0, p.attention_offload,
            e.mesh_shape.dp_replicate, e.mesh_shape.window, p.expert_chunk, e.mesh_shape.expert)


def bound_keys(req: Request, found: list[Footprint]) -> Callable[[Footprint], tuple]:
    """For each candidate a key no larger than _sort_key of its estimate: its step is at least its
    compute, the FSDP time its layout and micro-batch leave exposed at their least (gradients reduced
    once per step, the most recomputation any of their candidates runs behind it: exposure only falls
    with more compute to hide behind) and co2's exposed outer all-reduce; the shown (rounded) time is
    monotone in the time."""
    most: dict[tuple, Footprint] = {}  # (layout, micro-batch) -> its candidate with the most recomputation
    for fp in found:
        key = (fp.mesh_shape, fp.micro_batch)
        if key not in most or fp.acts.recompute_flops > most[key].acts.recompute_flops:
            most[key] = fp
    hw = req.hardware
    fsdp = {key: exposed_fsdp_seconds(req.model, fp.mesh_shape, dataclasses.replace(fp.policy, grad_sync="step"),
                                      fp.grad_accum, hw.dtype_bytes,
                                      predicted_block_forward_seconds(fp.flops, req.model, hw),
                                      fp.acts.recompute_flops, hw, req.gpus_per_node) for key, fp in most.items()}
    return lambda fp: (0, float(step_text(fp.lower_bound_s + fsdp[fp.mesh_shape, fp.micro_batch] + fp.co2_outer)))


def held(req: Request, shape: MeshShape) -> bool:
    """co2 plans are held out of the ranking (reported beside it) unless the request allows co2."""
    return shape.data_parallel == "co2" and "co2" not in req.allow


def plan(req: Request, keep_infeasible: bool = True, explain: bool = True) -> PlanResult:
    """Every candidate that fits, ranked by predicted step time (a Ranking: timed as read; the best is
    timed here). keep_infeasible: when nothing fits, every candidate ranked by memory (all timed), for
    the table and the suggestions."""
    t0 = time.perf_counter()
    acts_cache: dict = {}
    found, evaluated = _evaluate(req, False, acts_cache)

    def complete(fp: Footprint) -> Estimate:
        return timed(req.model, req.hardware, fp, seq_len=req.seq_len, global_batch=req.global_batch,
                     gpus_per_node=req.gpus_per_node, expert_skew=req.expert_skew)

    if found or not keep_infeasible:
        bound = bound_keys(req, found)
        ranked, held_out = (Ranking([fp for fp in found if held(req, fp.mesh_shape) == hold], complete, _sort_key,
                                    bound) for hold in (False, True))
        ranked[:1]  # the best, within the search's seconds
    else:
        found, more = _evaluate(req, True, acts_cache)
        evaluated += more
        every = sorted(map(complete, found), key=_sort_key)
        ranked, held_out = [e for e in every if not held(req, e.mesh_shape)], []
    res = PlanResult(req, ranked, evaluated, time.perf_counter() - t0, co2_plans=held_out)
    if explain and not res.feasible:
        res.suggestions = suggest(req, res)
    return res


def _evaluate(req: Request, keep_infeasible: bool, acts_cache: dict,
              first_only: bool = False) -> tuple[list[Footprint], int]:
    """Every candidate's footprint in its first tier that fits (keep_infeasible: every tier's, when none
    does); first_only: stop at the first that fits (whether any does)."""
    hw, m = req.hardware, req.model
    pols = policies(req)
    # every policy in both gradient-sync variants, in policy order, and what the checks below compare
    # each with, made once (not per shape and micro-batch: tens of thousands of dataclass copies)
    by_sync = {g: [dataclasses.replace(p, grad_sync=g) for p in pols] for g in ("step", "micro_batch")}
    in_order = {syncs: [by_sync[g][i] for i in range(len(pols)) for g in syncs]
                for syncs in (("step",), ("step", "micro_batch"))}
    as_step = {v: s for g in by_sync for v, s in zip(by_sync[g], by_sync["step"])}
    unchunked = {v: dataclasses.replace(v, expert_chunk=0) for g in by_sync for v in by_sync[g] if v.expert_chunk}
    results: list[Footprint] = []
    evaluated = 0
    for shape in candidate_shapes(req):
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
            fit_whole = set()  # policies that fit with the experts' rows whole (expert_chunk 0)
            for pol in in_order[syncs]:
                if pol.block_chunk and pol.block_chunk >= tokens:
                    continue  # one chunk: the same as whole blocks
                if pol.expert_chunk and unchunked[pol] in fit_whole:
                    continue  # expert pieces only add recomputation where whole rows fit
                if pol.attention_chunk and pol.attention_chunk >= tokens * shape.head:
                    continue  # the core's tokens (after the head all-to-all) fit one chunk
                # activations and the backward transient (which the Double-Ring window changes): the same
                key = (shape.head, shape.ctx, shape.window, shape.expert, mb, as_step[pol])
                acts_for = functools.partial(_tier_activations, acts_cache, key, req, shape, mb, pol)
                kept, n = _tiers(req, shape, mb, pol, acts_for, static, keep_infeasible)
                evaluated += n
                if kept and kept[-1].feasible and not pol.expert_chunk:
                    fit_whole.add(pol)
                results += kept
                if first_only and any(not held(req, fp.mesh_shape) for fp in kept):
                    return results, evaluated
    return results, evaluated


def _tier_activations(cache: dict, key: tuple, req: Request, shape: MeshShape, mb: int, pol: MemoryPolicy,
                      tier: str) -> tuple:
    """(activations, transient bytes) of a candidate under `tier`, computed once per `key` and activation
    dtype: one process off the host tier computes in autocast over fp32 weights (activation_dtype)."""
    e, copies = activation_dtype(req.hardware.dtype_bytes == 2, shape.world, tier)
    if (key, e, copies) not in cache:
        cache[key, e, copies] = rank_activations(req.model, req.seq_len, mb, shape, pol, e, req.doc_mask,
                                                 req.expert_skew, weight_copies=copies)
    return cache[key, e, copies]


def _tiers(req: Request, shape: MeshShape, mb: int, pol: MemoryPolicy, acts_for, static: dict[str, float],
           keep_infeasible: bool) -> tuple[list[Footprint], int]:
    """One candidate in the first model-state tier that fits, tried in req.model_states' order
    (device, host_optimizer, host): for the same layout, policy and micro-batch a host tier adds
    host-link and host AdamW time to the same compute, so it is never faster than a tier before it
    that fits, and holds no less in host memory. Returns (the footprints kept, the number made):
    with keep_infeasible every tier tried when none fits, else only a feasible one. `acts_for(tier)`: the
    (activations, transient bytes) of this candidate under that tier."""
    hw, made = req.hardware, []
    usable = hw.usable_memory_bytes
    grad_accum = max(1, req.global_batch // (shape.dp * mb))
    # co2 keeps its outer state beside the weights on the device (config/data_parallel.py)
    for tier in req.model_states if shape.data_parallel != "co2" else ("device",)[:"device" in req.model_states]:
        acts, transient = acts_for(tier)
        if not keep_infeasible and (static[tier] + acts.total_device + transient > usable or
                                    memory_bytes(req.model, shape, pol, grad_accum, hw.dtype_bytes, acts, transient,
                                                 tier, req.settings)["total"] > usable):
            continue  # the GPU's memory alone rules it out (estimate's own sum, before its time)
        fp = footprint(req.model, hw, shape, pol, seq_len=req.seq_len, global_batch=req.global_batch,
                       micro_batch=mb, gpus_per_node=req.gpus_per_node, doc_mask=req.doc_mask,
                       doc_work=req.doc_work, acts=acts, transient=transient, expert_skew=req.expert_skew,
                       model_states=tier, co2_steps=req.co2_local_steps, settings=req.settings)
        made.append(fp)
        if fp.feasible:
            return [fp], len(made)
        if fp.host_per_node > hw.usable_host_bytes and not keep_infeasible:
            break  # the tiers after it keep more in host memory, not less
    return (made if keep_infeasible else []), len(made)


def _fits(req: Request, **changes) -> bool:
    """Whether any candidate of the changed request fits (the search stops at the first)."""
    found, _ = _evaluate(dataclasses.replace(req, **changes), False, {}, first_only=True)
    return bool(found)


def _host_memory_suggestion(req: Request, res: PlanResult) -> list[str]:
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
        if _fits(req, hardware=hw.replace(host_memory_gib=gib)):
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


def suggest(req: Request, res: PlanResult) -> list[str]:
    """What would make an infeasible request feasible."""
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
        if _fits(req, **with_offload):
            out.append("activation offload (memory.offload_fraction with full or selective recomputation) makes "
                       "it feasible")
        else:
            for factor in (2, 4, 8):
                host = req.hardware.host_memory_gib * factor
                if _fits(req, hardware=req.hardware.replace(host_memory_gib=host), **with_offload):
                    out.append(f"activation offload makes it feasible with {host:,.0f} GiB of host memory per node "
                               f"(--hw host_memory_gib={host:.0f})")
                    break
    host_text = _host_memory_suggestion(req, res)
    out += host_text
    if not host_text and least.host_per_node > req.hardware.usable_host_bytes and req.hardware.host_memory_gib:
        need = least.host_per_node / req.hardware.usable_host_fraction / 2**30
        out.append(f"nodes with >= {need:,.0f} GiB of host memory (--hw host_memory_gib=...) would hold the "
                   f"offloaded activations")
    if (0 not in req.loss_chunks or len(req.loss_chunks) == 1) and _fits(req, loss_chunks=(0, 4096)):
        out.append("a chunked LM head + loss (memory.loss_chunk) makes it feasible")
    g = req.gpus
    for _ in range(6):
        g *= 2
        if g > req.gpus_per_node and g % req.gpus_per_node:
            continue  # not whole nodes: Request would refuse it
        if _fits(req, gpus=g, global_batch=req.global_batch * g // req.gpus):
            out.append(f"{g} GPUs make it feasible")
            break
    seq = req.seq_len
    for _ in range(8):
        seq //= 2
        if seq < 2 * req.gpus and seq < 1024:
            break
        if _fits(req, seq_len=seq):
            out.append(f"a sequence of {seq:,} tokens fits on {req.gpus} GPUs")
            break
    return out
