"""The search's lower bound of a candidate's sort key (planner/ranking.py keeps candidates in a heap under it and
times one only when its bound comes first), and the step time as the table shows it, which both keys read.

The bound is a sum of parts of the step that `timed` (planner/cost.py) adds without subtracting anything:

- the compute (Footprint.lower_bound_s);
- the FSDP time its layout and micro-batch leave exposed at their least (gradients reduced once per step, behind
  the most recomputation any of their candidates runs: exposure only falls with more compute to hide behind);
- co2's exposed outer all-reduce;
- under expert parallelism, the expert all-to-alls on the most loaded rank and its straggler's GEMMs, the very
  figure `timed` adds (cost.exposed_expert_parts of comm_bytes.expert_step_bytes): the policy enters those bytes
  only through its MoE forward runs (memory/moe_counts.py moe_forward_runs: 1 + the recomputed share per layer),
  so it is computed once per (layout, micro-batch, forward runs). FlexMoE's copies' fetches (a function of the
  policy's calls, not of its forward runs) are left out: they only add.

Until 2026-12-07 the bound had no expert term, and a MoE request timed ~30% of its feasible plans (qwen3-30b-a3b
on 16 x H100 at 32K: 14,647 of 47,890). The parts are summed in another order than `timed` sums the step, so a bound
with an expert term is taken 1e-12 below its sum (float rounding is ~1e-16 a term; without it small-moe's
dp4xctx4 ep16 hier4 under full recomputation, whose step is these parts alone, was bounded 1 ulp above its step);
tests/unit/test_planbound121.py holds bound <= step over randomized plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..costs.shape import MeshShape
from ..costs.timing import exposed_fsdp_seconds, predicted_block_forward_seconds
from .comm_bytes import _forward_runs, expert_step_bytes
from .cost import Footprint, exposed_expert_parts, planned_skew
from .request import Request

# what a bound with an expert term is taken below its sum: its parts are added in another order than the step's
ROUNDING = 1e-12


def step_text(step_s: float) -> str:
    """A predicted step time as the table shows it (4 significant digits); the ranking sorts by it."""
    return f"{step_s:.4g}"


def bound_keys(req: Request, found: list[Footprint]) -> Callable[[Footprint], tuple]:
    """For each candidate a key no larger than search._sort_key of its estimate: bound_seconds as the table shows
    it (the shown, rounded, time is monotone in the time)."""
    seconds = bound_seconds(req, found)
    return lambda fp: (0, float(step_text(seconds(fp))))


def bound_seconds(req: Request, found: list[Footprint]) -> Callable[[Footprint], float]:
    """For each candidate (of `found`, or another of their layouts and micro-batches) seconds no more than its
    step's (the module docstring)."""
    # a layout by the number of its class of equal shapes: the candidates of one layout share its MeshShape object,
    # so an object is hashed once, not once per candidate (seen keeps each object, so its id stays its own)
    seen: dict[int, tuple[MeshShape, int]] = {}
    classes: dict[MeshShape, int] = {}

    def layout(shape: MeshShape) -> int:
        hit = seen.get(id(shape))
        if hit is None or hit[0] is not shape:
            hit = seen[id(shape)] = (shape, classes.setdefault(shape, len(classes)))
        return hit[1]

    most: dict[tuple, Footprint] = {}  # (layout, micro-batch) -> its candidate with the most recomputation
    for fp in found:
        key = (layout(fp.mesh_shape), fp.micro_batch)
        if key not in most or fp.acts.recompute_flops > most[key].acts.recompute_flops:
            most[key] = fp
    hw = req.hardware
    fsdp = {key: exposed_fsdp_seconds(req.model, fp.mesh_shape, dataclasses.replace(fp.policy, grad_sync="step"),
                                      fp.grad_accum, hw.dtype_bytes,
                                      predicted_block_forward_seconds(fp.flops, req.model, hw),
                                      fp.acts.recompute_flops, hw, req.gpus_per_node) for key, fp in most.items()}
    expert = expert_bound(req, layout)

    def bound(fp: Footprint) -> float:
        base = fp.lower_bound_s + fsdp[layout(fp.mesh_shape), fp.micro_batch] + fp.co2_outer
        x = expert(fp)
        return (base + fp.grad_accum * x) * (1 - ROUNDING) if x else base

    return bound


def expert_bound(req: Request, layout: Callable[[MeshShape], int]) -> Callable[[Footprint], float]:
    """A candidate's expert seconds per micro-batch as `timed` adds them (cost.exposed_expert_parts' "expert"), 0
    for a dense model or expert degree 1; FlexMoE's copies' fetches left out. Kept per (layout, micro-batch, forward
    runs); a candidate's forward runs per (policy object, tokens) (the search shares policy objects)."""
    m, hw = req.model, req.hardware
    if not m.is_moe:
        return lambda fp: 0.0
    runs: dict[tuple[int, int], tuple[object, float]] = {}
    seconds: dict[tuple[int, int, float], float] = {}

    def expert(fp: Footprint) -> float:
        shape = fp.mesh_shape
        if shape.expert == 1:
            return 0.0
        hit = runs.get((id(fp.policy), fp.tokens))
        if hit is None or hit[0] is not fp.policy:
            hit = runs[id(fp.policy), fp.tokens] = (fp.policy, _forward_runs(m, fp.tokens, fp.policy))
        key = (layout(shape), fp.micro_batch, hit[1])
        x = seconds.get(key)
        if x is None:
            skew = planned_skew(m, shape, req.expert_skew)
            comm = expert_step_bytes(m, shape, fp.policy, fp.tokens, fp.grad_accum, hw.dtype_bytes, skew)
            if "expert" in comm:  # (the copies' fetches: not a function of the forward runs)
                comm["expert"] = {k: v for k, v in comm["expert"].items() if k != "expert_copies"}
            x = seconds[key] = exposed_expert_parts(m, hw, shape, comm, fp.grad_accum, fp.tokens, skew,
                                                    req.gpus_per_node)["expert"]
        return x

    return expert
