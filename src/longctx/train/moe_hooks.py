"""The MoE step hook (hooks.py): everything a training step does for the routers, beside the loop.

- before a step: the routers learn the step (DTS-Gate's schedule reads it), and the expert
  dispatcher's decisions at this boundary are said (parallel/expert/install.py expert_step_notes: online
  chunk tuning, FlexMoE's placement from the last step's choices per expert);
- after each micro-batch's forward: the router terms (models/moe.py RouterTerms): their balancing
  losses join the backward as a mean over the step's micro-batches, and their statistics (stats,
  choices per expert, per-layer loads, choices dropped) are summed on the device;
- after the optimizer step: the aux-loss-free selection bias moves toward an even load
  (moe.bias_update_rate; not for a step whose update was not applied: its counts are zeroed on the
  device, so the bias moves by sign(mean - count) = 0), and the step's figures join the metrics
  interval (router_metrics.py RouterInterval: interval means, the heatmap's per-expert columns);
- at a metrics line: the interval's figures; at a rollback: the interval forgotten (its steps run
  again); at an evaluation: how it routed, where that depends on the step;
- at a save and a resume (or rollback): the last step's choices and FlexMoE's placer (state_dict).

A run installs this hook only when it trains routers (`moe_step_hooks`): a dense model, or a GliDe
draft trained against an MoE target, has none.
"""

from __future__ import annotations

import torch

from ..config import Config
from ..job.runtime import Runtime
from ..models.moe import moe_layers
from ..models.moe_eval_routing import eval_routing_note
from ..parallel.expert.install import expert_placer, expert_step_notes
from ..parallel.expert.placement import Placement
from ..step.loss import router_loss
from .hooks import StepHook
from .model import model_kind
from .router_metrics import RouterInterval, heatmap_every


def moe_step_hooks(cfg: Config, model: torch.nn.Module, rt: Runtime, log=print) -> list[StepHook]:
    """[MoEStepHook] for a run that trains routers (model_kind "moe"), else []."""
    return [MoEStepHook(cfg, model, rt.dims.expert, log)] if model_kind(cfg) == "moe" else []


class MoEStepHook(StepHook):
    """The routers' part of each step. `router_counts`: the last step's rows per expert [layers, E] over every
    rank, the choices each expert ran (kept by a capacity; None before the first step): what FlexMoE's placement
    reads, as its copies take a share of the rows an expert runs (dropped choices never travel)."""

    def __init__(self, cfg: Config, model: torch.nn.Module, expert: int, log=print):
        m = cfg.model
        self.model, self.log = model, log
        self._layers = moe_layers(model)  # (found once: each step reads their placements)
        self.capacity = m.moe_capacity_factor > 0  # (without one nothing is dropped: no drop figures)
        every = heatmap_every(cfg.metrics.log_interval, cfg.train.steps)
        self.interval = RouterInterval(m.moe_layer_ids, expert, every,
                                       self._layers if m.moe_bias_update_rate > 0 else ())
        self.router_counts: torch.Tensor | None = None
        self._step = _StepSums()
        self._shares: tuple[tuple, torch.Tensor | None] = ((), None)  # (the placements, their rank shares)

    def step_start(self, step: int) -> None:
        self.model.set_router_step(step - 1)
        for note in expert_step_notes(self.model, step, self.router_counts):
            self.log(note)
        self._step = _StepSums()

    def after_forward(self, micro_batches: int, scale: float) -> torch.Tensor | None:
        # the balancing losses: a mean over the micro-batches (one of padding adds 0: models/moe_stats.py), as
        # step/loss.py router_loss gives them to every step (the planner's validation and the memory bench too)
        loss, terms = router_loss(self.model, micro_batches, scale)
        if terms is not None:
            self._step.add(terms)
        return loss

    def after_optimizer(self, step: int, applied: torch.Tensor) -> None:
        s = self._step
        if s.counts is None:
            return
        # once per optimizer step, from every micro-batch's choices
        self.model.update_expert_bias(s.counts * applied)
        # (a step whose update was not applied, non-finite or a spike, leaves the placer the last applied one's
        # choices: a NaN forward's are no routing; a where, not an if: no host sync). Counts a checkpoint restored
        # are where the step's are (load_state_dict): the .to is none, kept for counts restored elsewhere
        last = self.router_counts
        self.router_counts = s.rows if last is None else torch.where(applied, s.rows, last.to(s.rows.device))
        self.interval.add(step, s.stats, s.layer_load, s.counts, applied, s.dropped if self.capacity else None,
                          self._placement_shares(s.counts), rows=s.rows)

    def _placement_shares(self, counts: torch.Tensor) -> torch.Tensor | None:
        """[layers, E, expert]: this step's share of each expert's rows on each expert rank, under FlexMoE's
        copies (parallel.expert_replicas; the placement of each layer's experts), else None (the static
        placement). Built again only when a placement changes (once per placement window)."""
        placements = tuple(getattr(m.experts, "placement", None) for m in self._layers)
        if all(p is None for p in placements):
            return None
        if placements != self._shares[0]:
            static = Placement.static(counts.shape[1], self.interval.expert)
            rows = [(p or static).rank_shares() for p in placements]
            self._shares = (placements, torch.tensor(rows, dtype=torch.float64, device=counts.device))
        return self._shares[1]

    def log_fields(self, step: int, last: bool) -> dict:
        return self.interval.record(step, last=last)

    def eval_note(self) -> str | None:
        notes = (eval_routing_note(self.model), "dropless (moe.capacity_factor applies to training steps only)"
                 if self.capacity else None)
        return "; ".join(n for n in notes if n) or None

    def rolled_back(self) -> None:
        self.interval.reset()  # (its sums hold steps the rollback discarded)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON, trainer_state.json "moe"): the last step's choices per expert, which
        FlexMoE's placer reads at the next step, and the placer's window and placements, so a resumed run
        places its expert copies as the uninterrupted one does."""
        placer, counts = expert_placer(self.model), self.router_counts
        return {"router_counts": None if counts is None else counts.tolist(),
                "placer": None if placer is None else placer.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state_dict (None: one written before it was saved; the placer starts static)."""
        state = state or {}
        placer, counts = expert_placer(self.model), state.get("router_counts")
        # where the step's counts are made: the buffers' device (RoPE's, the routers' bias), the accelerator's
        # also under memory.model_states = host, whose parameters are in host memory; restored there, a step's
        # torch.where met them there and copied them over, waiting for the device (a plain host-to-device copy),
        # and the placer's window (restored beside w1) met the next step's counts: a GPU refused the add
        device = next(self.model.buffers()).device
        if placer is not None:
            placer.load_state_dict(state.get("placer"), device)
        self.router_counts = None if counts is None else torch.tensor(counts, dtype=torch.float32, device=device)


class _StepSums:
    """One optimizer step's router figures over its micro-batches, on the device: stats and per-layer
    max/mean loads as means over the micro-batches holding a real token (one entirely of padding has no
    load to average), choices per expert, rows per expert (the choices kept) and dropped choices as sums."""

    def __init__(self):
        self.counts = self.rows = self.dropped = self._stats = self._layer_load = self._routed = None

    def add(self, terms) -> None:
        routed = (terms.counts.sum() > 0).to(terms.stats.dtype)  # (counts are over every rank: all agree)
        self._stats = terms.stats * routed + (0 if self._stats is None else self._stats)
        self._layer_load = terms.layer_load * routed + (0 if self._layer_load is None else self._layer_load)
        self._routed = routed + (0 if self._routed is None else self._routed)
        self.counts = terms.counts + (0 if self.counts is None else self.counts)
        self.rows = terms.rows + (0 if self.rows is None else self.rows)
        self.dropped = terms.dropped + (0 if self.dropped is None else self.dropped)

    @property
    def stats(self) -> torch.Tensor:
        # the drop rate is the step's choices dropped over its choices (as moe_layer_drop), not a mean of the
        # micro-batches' rates: a micro-batch of few real tokens (padding) would weigh as much as a full one
        stats = self._stats / self._routed.clamp_min(1)
        rate = self.dropped.sum() / self.counts.sum().clamp_min(1)
        return torch.cat([stats[:4], rate.reshape(1).to(stats.dtype), stats[5:]])

    @property
    def layer_load(self) -> torch.Tensor:
        return self._layer_load / self._routed.clamp_min(1)
