"""Experts per token that the memory counts bound a run at (`peak_top_k`): the routers route top_k every step but
DTS-Gate, whose schedule starts dense. One place, read by every count of saved tensors, transients, host parts and
dispatch buffers (memory/moe_counts.py, hier_counts.py, transients.py, hier_transients.py), so that a router with a
schedule is counted at its widest step; the FLOP, time and communication-volume counts read moe.top_k itself.
A resumed run is counted from the step it resumes at (`from_step`): its widest step still to run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..config import ModelConfig
from ..config.per_model import per_model
from ..models.moe import scheduled_experts


def peak_top_k(m: ModelConfig) -> int:
    """Experts per token the counts that bound peak memory take (activations, transients, host parts, the planner's
    memory columns): the most any step of the run routes. top_k, except for the DTS-Gate router (moe.router dts),
    which routes every expert at step 0 and anneals to top_k over moe.dts_steps (models/moe.py scheduled_experts):
    E, what step 0 routes (top_k at dts_steps 0). A model `from_step` a resumed run's first step is counted at
    what that step routes, the widest of the steps left (the schedule only narrows): top_k past the schedule.
    FLOP, time and communication-volume counts stay at top_k (the run's steady state)."""
    if m.moe_router == "dts":
        return scheduled_experts(m.moe_experts, m.moe_top_k, getattr(m, "dts_from_step", 0), m.moe_dts_steps)
    return m.moe_top_k


@dataclasses.dataclass
class ResumedModel(ModelConfig):
    """A model config as the steps from `dts_from_step` (0-based, a resumed run's first) on count it: peak_top_k
    reads the step. Not a config key: made by `from_step` for the counts alone, never written to a config."""

    dts_from_step: int = 0


def from_step(m: ModelConfig, step: int) -> ModelConfig:
    """`m` as a run whose first step left to run is optimizer `step` (0-based: a resume of a checkpoint of `step`
    steps) counts it: a DTS-Gate model at the widest step still to run (models/moe.py scheduled_experts at `step`),
    not step 0's E, which no step left routes. `m` itself at step 0 or without a schedule. The host budget and
    memory.offload_fraction auto count a resume this way (train/host_budget.py counted_model); the planner plans a
    run from its start."""
    if m.moe_router != "dts" or step <= 0:
        return m
    return _resumed(m, step)


# one object per (m, step), as long as m lives (a config is never changed once built): the counts remembered per
# model object (per_model, costs/model_states.py's too) built a meta model again for each new one, each call
@per_model
def _resumed(m: ModelConfig, step: int) -> ResumedModel:
    """from_step's model: `m`'s fields and the step."""
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelConfig)}
    return ResumedModel(**fields, dts_from_step=step)


def at_top_k(m: ModelConfig, k: int) -> ModelConfig:
    """The model as a step that routes `k` experts per token counts it (peak_top_k of it is k)."""
    return dataclasses.replace(m, moe_top_k=k, moe_dts_steps=0)


def chunk_fitting_top_ks(m: ModelConfig, expert_chunk: int, rows_at: Callable[[int], list[float]]) -> list[int]:
    """The experts per token below peak_top_k at which a count can be larger than at the peak: memory.expert_chunk
    runs a call's experts in checkpointed pieces past expert_chunk routed rows, which keep no intermediates, so a
    DTS-Gate step routing fewer experts, whose call then runs them whole, can keep more than step 0 (E 4, top_k 1,
    expert_dim 80, expert_chunk 64, 48 tokens: 194,212 B at top_k against 164,308 B at step 0). For each call (
    `rows_at(k)`: every call's routed rows at k experts per token) the largest k whose rows fit the chunk, where
    they do not at the peak; every k from top_k up is taken as routed (a schedule of fewer steps than E - top_k
    skips some: an upper bound). Empty without a schedule or a chunk."""
    peak = peak_top_k(m)
    if not expert_chunk or peak == m.moe_top_k:
        return []
    return [k for k in range(m.moe_top_k, peak)
            if any(a <= expert_chunk < b for a, b in zip(rows_at(k), rows_at(k + 1)))]


def over_schedule(count: Callable[[ModelConfig], float], m: ModelConfig) -> float:
    """The largest of `count` over every experts-per-token count a run routes (top_k to peak_top_k), for the
    transients beside the saved activations whose bytes are not the largest at the peak: the shared experts'
    overlap (within the feed-forward's backward at E, beyond it at top_k) and hierarchical dispatch's stages (as
    expert_transients.expert_skew_transient_bytes takes the skewed rank's extra rows). Counted at the peak alone, a
    DTS-Gate rank's total was 0.59x at worst of what a later step holds (tests/unit/test_review117d.py). Added to
    the activations' peak: an upper bound (each term's largest, not always at one step; 1.16x there). `count(m)`
    alone without a schedule."""
    peak = peak_top_k(m)
    if peak == m.moe_top_k:
        return count(m)
    return max(count(at_top_k(m, k)) for k in range(m.moe_top_k, peak + 1))
