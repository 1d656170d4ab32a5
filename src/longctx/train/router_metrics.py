"""MoE router figures of a metrics line: interval means, per-layer loads, per-expert loads (the
report's heatmap) and the aux-loss-free selection bias.

Each optimizer step's figures (models/moe.py RouterTerms: `stats` and the choices per expert
`counts` [layers, E], both over every rank, so the same on every rank) are added to a few device
tensors (`RouterInterval.add`: adds and a max, no host read, so a step never waits for the device);
the sums are read in one transfer when the metrics line is written (`RouterInterval.record`).

What a record holds (docs/moe.md, Metrics):
- `moe_aux_loss`, `moe_z_loss`, `moe_load_mean`, `moe_load_worst`, `moe_drop_rate` (and under
  expert parallelism `expert_rank_load`, from the rows the experts ran: a capacity's drops never reach
  a rank): the mean over the interval's steps of each step's figure;
- `moe_layer_load` [layers]: per MoE layer, the interval's mean max/mean choices per expert (its mean
  over layers is `moe_load_mean`), and `moe_blocks`: the block each MoE layer is;
- `moe_layer_drop` [layers], with a capacity (moe.capacity_factor > 0): per MoE layer, the fraction
  of the interval's choices dropped (its dropped choices over all its choices);
- `moe_bias_norm` [layers], with aux-loss-free routing (moe.bias_update_rate > 0): the L2 norm of
  each router's selection bias as it stands at the line;
- `moe_expert_load` [layers][E] (with `moe_expert_load_from`, the first step it covers): each
  expert's share of its layer's choices, as a percentage of an even share (100 = 1/E of them;
  integers). It covers every step since the previous record that carried it; a record carries it
  every `heatmap_every` steps, a multiple of the log interval chosen so that a run has at most
  EXPERT_LOAD_COLUMNS of them: the file holds at most 100 x layers x E such integers (about 3 MB
  for 48 layers of 128 experts), however long the run or short its log interval.

A step whose update the guard did not apply (train.on_nonfinite, train.spike_factor) is left out,
as the bias update leaves it out: its figures may be non-finite.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

ROUTER_FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate")
EXPERT_LOAD_COLUMNS = 100  # per-expert loads recorded at most this many times in a run (the heatmap's columns)


def rank_load(counts: torch.Tensor, expert: int, shares: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens the busiest rank of an expert group runs over the mean, worst MoE layer (0-d),
    from the rows each expert runs [layers, E] (under a capacity its kept choices, not the router's:
    a dropped choice never reaches a rank): experts placed in contiguous blocks of E / expert, or with
    `shares` [layers, E, expert] (FlexMoE's copies: parallel/expert/placement.py rank_shares) each
    expert's rows split over the ranks that run it. The rows are every rank's pooled, as the placement
    policy reads them: with several expert groups, their mean rank load."""
    if shares is None:
        per_rank = counts.view(counts.shape[0], expert, -1).sum(-1)
    else:
        per_rank = torch.einsum("le,leq->lq", counts.to(shares.dtype), shares)
    mean = per_rank.mean(1)
    # (a layer of no choice at all, a step of padding only: balanced, not 0 / 0)
    return torch.where(mean > 0, per_rank.max(1).values / mean.clamp_min(1e-30), 1.0).max()


def heatmap_every(log_interval: int, steps: int) -> int:
    """Steps between records carrying the per-expert loads: a multiple of the log interval such that
    a run of `steps` steps has at most EXPERT_LOAD_COLUMNS of them."""
    return log_interval * max(1, math.ceil(steps / (log_interval * EXPERT_LOAD_COLUMNS)))


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A buffer every rank holds whole (a plain tensor, as FSDP2 leaves buffers), or a DTensor: a
    replicated one's local tensor (no communication), a sharded one gathered (a collective: every
    rank must call it, as every rank writes its metrics line)."""
    if isinstance(t, DTensor):
        return t.to_local() if all(p.is_replicate() for p in t.placements) else t.full_tensor()
    return t


class RouterInterval:
    """The router figures of the steps since the last metrics line, summed on the device.

    `blocks`: the block index of each MoE layer (config moe_layer_ids); `expert`: the expert-parallel
    degree (> 1 adds expert_rank_load); `every`: heatmap_every; `bias_layers`: the MoE layers whose
    routers' `expert_bias` is recorded (empty without aux-loss-free routing)."""

    def __init__(self, blocks, expert: int = 1, every: int = 1, bias_layers=()):
        self.blocks, self.expert, self.every = list(blocks), expert, every
        self.bias_layers = list(bias_layers)
        self._sums: torch.Tensor | None = None    # [5 + layers (+ 1)]: summed step figures
        self._steps: torch.Tensor | None = None   # 0-d: steps added whose update was applied
        self._counts: torch.Tensor | None = None  # [layers, E]: choices since the last heatmap column
        self._column_from: int | None = None      # the first step in _counts

    def add(self, step: int, stats: torch.Tensor, layer_load: torch.Tensor, counts: torch.Tensor,
            applied: torch.Tensor, dropped: torch.Tensor | None = None, shares: torch.Tensor | None = None,
            rows: torch.Tensor | None = None) -> None:
        """One optimizer step (1-based): its stats [5] and per-layer max/mean [layers] (each the mean
        over its micro-batches), its choices per expert [layers, E] and choices dropped per layer
        [layers] (summed over them; None: no capacity, nothing dropped) and whether its update was
        applied (0-d bool): device tensors, left there. `shares`: the step's expert placement (rank_load).
        `rows` [layers, E]: the choices each expert ran (kept by a capacity; None: the choices), what
        expert_rank_load reads: a dropped choice never reaches a rank, so it is no load of one."""
        if counts.shape[0] != len(self.blocks):  # (shapes are host metadata: no device read)
            raise ValueError(f"router counts for {counts.shape[0]} MoE layers, but the model config names "
                             f"{len(self.blocks)} (blocks {self.blocks})")
        parts = [stats.double(), layer_load.double()]
        if self.expert > 1:
            parts.append(rank_load(counts if rows is None else rows, self.expert, shares).double().reshape(1))
        if dropped is not None:  # (per layer: dropped choices, then all choices; their ratio is the rate)
            parts += [dropped.double(), counts.double().sum(1)]
        row = torch.where(applied, torch.cat(parts), 0.0)  # (0 x NaN would be NaN)
        counts = torch.where(applied, counts.double(), 0.0)
        applied = applied.double()
        if self._sums is None:
            self._sums, self._steps = row, applied
        else:
            self._sums, self._steps = self._sums + row, self._steps + applied
        self._counts = counts if self._counts is None else self._counts + counts
        if self._column_from is None:
            self._column_from = step

    def reset(self) -> None:
        """Forget the steps added since the last record (a rollback discarded them: they run again)."""
        self._sums = self._steps = self._counts = None
        self._column_from = None

    def record(self, step: int, last: bool = False) -> dict:
        """The figures of the steps added since the last call, read in one transfer; then a new
        interval. `last`: the run's last step (its heatmap column closes whatever the spacing).
        Empty when no step was added."""
        if self._sums is None:
            return {}
        layers = len(self.blocks)
        column = last or step % self.every == 0
        packed = [self._steps.reshape(1), self._sums]
        if column:
            packed.append(self._counts.flatten())
        if self.bias_layers:  # (a few kB once per line: not worth keeping a copy between lines)
            bias = torch.stack([replicated_value(m.router.expert_bias).detach().double() for m in self.bias_layers])
            packed.append(bias.norm(dim=1))
        values = torch.cat([p.to(self._sums.device) for p in packed]).tolist()  # the one host read
        steps, values = values[0], values[1:]
        sums, values = values[: len(self._sums)], values[len(self._sums):]
        record: dict = {}
        if steps:
            means = [s / steps for s in sums]
            record.update(zip(ROUTER_FIELDS, means))
            record["moe_layer_load"] = [round(v, 3) for v in means[5: 5 + layers]]
            if self.expert > 1:
                record["expert_rank_load"] = means[5 + layers]
            drops = sums[5 + layers + (self.expert > 1):]
            if drops:
                record["moe_layer_drop"] = [round(d / max(c, 1), 4) for d, c in zip(drops[:layers], drops[layers:])]
            record["moe_blocks"] = self.blocks
        if column:
            n = self._counts.numel()
            counts, values = values[:n], values[n:]
            experts = n // layers
            rows = [counts[i * experts:(i + 1) * experts] for i in range(layers)]
            if any(sum(r) for r in rows):
                record["moe_expert_load"] = [[round(100 * experts * c / max(sum(r), 1)) for c in r] for r in rows]
                record["moe_expert_load_from"] = self._column_from
            self._counts, self._column_from = None, None
        if self.bias_layers:
            record["moe_bias_norm"] = [float(f"{v:.4g}") for v in values]
        self._sums = self._steps = None
        return record
