"""The in-training evaluation (Trainer.evaluate): the mean loss over every labelled token of the first
train.eval_batches global batches of eval samples, and over a mix of stores (data/store_mix.py StoreMix)
each store's too: the mean over that store's labelled tokens among the same sequences.

A store's loss comes out of the blend's one forward: the model scores each token (its "tokens" reduction,
chunked by memory.loss_chunk as the summed loss is), each rank adds its rows' sums into their stores'
slots (a [stores] float64 tensor on the device) and one all-reduce adds the ranks' slots; a rank under
context parallelism holds a part of each of its rows, and the parts' sums add up to the row's, as the
blend's sum does. Each store's label count is read for the whole global batch from its segment index
(StoreMix.label_counts), the same counts the blend's denominator sums: so the token-weighted mean of the
stores' losses is the blend's loss (to float rounding) under any layout and grad_accum. A GliDe draft
(draft.target) scores only a summed loss over the labels its vocabulary keeps: its evaluation records the
blend's loss alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.store_mix import StoreMix
from ..models.moe_eval_routing import dropless
from ..parallel.context.shares import read_local_batch, to_device
from ..parallel.fsdp.shard import reshard_units
from ..step.loss import forward_loss_sum, forward_token_losses


@dataclass
class Evaluation:
    loss: float  # the mean over every labelled token of the evaluated sequences (NaN: no label)
    by_store: dict[str, float] | None = None  # a mix's: each store's mean over its labelled tokens there


class StoreSums:
    """One evaluation's loss sums by store of a mix: this rank's rows' on the device, and every store's label
    count over the whole job's sequences on the host."""

    def __init__(self, mix: StoreMix, rt, device: torch.device):
        self.mix, self.rt = mix, rt
        self.sums = torch.zeros(len(mix.stores), dtype=torch.float64, device=device)
        self.counts = [0] * len(mix.stores)

    def add(self, model, batch, indices: list[int], autocast_dtype) -> torch.Tensor:
        """Score `batch`, this rank's share of the global batch of blend positions `indices`, adding each row's
        loss sum to its store's; returns the share's loss sum (the blend's part of it)."""
        row_sums = forward_token_losses(model, batch, autocast_dtype).double().sum(dim=1)
        mine = indices[self.rt.dp_rows(len(indices))]  # (the rows read_local_batch read for this rank)
        stores = torch.as_tensor(self.mix.stores_of(mine), device=row_sums.device)
        self.sums.index_add_(0, stores, row_sums)
        self.counts = [have + new for have, new in zip(self.counts, self.mix.label_counts(indices))]
        return row_sums.sum()

    def losses(self) -> dict[str, float]:
        """Each store's mean loss over the job (a collective: every rank calls it); NaN for a store with no label."""
        sums = self.rt.sum_tensor(self.sums).tolist()
        return {name: s / n if n else float("nan") for name, s, n in zip(self.mix.names, sums, self.counts)}


def store_sums(trainer) -> StoreSums | None:
    """The per-store sums of an evaluation of `trainer`'s eval samples: None unless they are a mix (and the
    model scores each token: not a GliDe draft)."""
    samples = trainer.eval_samples
    if not isinstance(samples, StoreMix) or trainer.cfg.draft.target:
        return None
    return StoreSums(samples, trainer.rt, trainer.device)


@torch.no_grad()
def evaluate_eval_set(trainer, label_count) -> Evaluation:
    """Trainer.evaluate's figures (see its docstring). `label_count(micro, valid)`: the labels the model scores
    in a micro-batch (step_run.py label_count: a draft's may be fewer than the store's count `valid`)."""
    model, samples, micro, rt = trainer.model, trainer.eval_samples, trainer.micro_step_sequences, trainer.rt
    global_batch = trainer.sampler.stage.global_batch
    # (a mix's stores of weight 0 are never drawn: their samples would only make the blend's repeat)
    size = samples.weighed_samples if isinstance(samples, StoreMix) else len(samples)
    n = min(size, trainer.cfg.train.eval_batches * global_batch) // global_batch * global_batch
    by_store = store_sums(trainer)
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=trainer.device), 0
    # dropless, as longctx eval scores: a MoE capacity is shared by a micro-batch's tokens (its loss would
    # depend on grad_accum and on which sequences are evaluated together)
    with dropless(model):
        for start in range(0, n, micro):
            indices = list(range(start, start + micro))
            share, valid = read_local_batch(rt, samples, indices)  # my tokens
            batch = to_device(share, trainer.device)
            if by_store is None:
                total += forward_loss_sum(model, batch, trainer.autocast_dtype)
            else:  # (the same one forward, scored by token)
                total += by_store.add(model, batch, indices, trainer.autocast_dtype)
            count = count + label_count([batch], valid)  # (a host int, or a draft's count on the device)
    model.train()
    # no backward follows to reshard the units: the next step, a save or a reader of the weights finds them as
    # training left them (parallel/fsdp/shard.py reshard_units)
    reshard_units(model)
    n = float(count)  # (one host read of each: the count may be a draft's, on the device)
    loss = float(rt.sum_tensor(total)) / n if n else float("nan")  # (no label: no loss)
    return Evaluation(loss, None if by_store is None else by_store.losses())
