"""The loss forward of a training step: the summed loss over a batch's valid labels, under autocast; the routers'
balancing losses an MoE model adds to it; what one micro-batch backwards (training_loss: the planner's validation
and `longctx bench memory` run the step training runs); and each label token's loss, for an evaluation that sums
them by row (train/evaluation.py)."""

from __future__ import annotations

import torch


def forward_loss_sum(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The summed loss over the batch's valid label tokens, each times its weight where the batch has
    weights (Batch.label_weights: train.loss_weighting = sequence); the caller normalises."""
    return _forward_with_labels(model, batch, autocast_dtype, "sum")


def router_loss(model: torch.nn.Module, micro_batches: int, scale: float):
    """After a micro-batch's forward: (the routers' balancing losses as its backward takes them, their RouterTerms)
    (models/moe_stats.py), or (None, None) for a model without routers (dense). The loss is this rank's share, a mean
    over the step's `micro_batches` times `scale` (parallel/fsdp/shard.py grad_scale), whatever the labels: as
    training adds it (train/moe_hooks.py), which also sums the terms' statistics."""
    terms = model.router_terms() if hasattr(model, "router_terms") else None
    return (None, None) if terms is None else (terms.loss * (scale / micro_batches), terms)


def training_loss(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None, weight,
                  micro_batches: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a training step backwards for one micro-batch, its summed LM loss): the summed loss times `weight`
    (the step's gradient scale over its labels: float or tensor) plus router_loss. A caller that trains without
    the step hooks (planner/validate_ranks.py, bench/memory.py) runs the step training runs: without the router
    terms an MoE model's step had neither their gradients nor their backward (the router records it frees)."""
    loss_sum = forward_loss_sum(model, batch, autocast_dtype)
    term = router_loss(model, micro_batches, scale)[0]
    total = loss_sum * weight
    return (total if term is None else total + term), loss_sum


def forward_token_losses(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Each label token's loss [rows, tokens] (0 where the label is ignored), forward only: the model's "tokens"
    reduction, chunked by memory.loss_chunk as the summed loss is. Models that score only a sum (a GliDe
    draft) refuse it."""
    return _forward_with_labels(model, batch, autocast_dtype, "tokens")[..., 0]


def _forward_with_labels(model, batch, autocast_dtype, reduction: str) -> torch.Tensor:
    # cache_enabled=False: autocast over fp32 weights (one GPU process off the host tier, bf16 on CPU) would keep
    # its bf16 copy of every weight the forward casts until this region ends, after the loss: 2 B per block
    # parameter on the device at the forward's end (13 GiB for an 8B), under every recompute policy. Uncached,
    # a copy lives as long as its matmul needs it (autograd saves it where the block is not recomputed:
    # memory/accounting.py layer_activations); a weight is cast at each use (once per forward; once per chunk under
    # memory.block_chunk: milliseconds of an 8B's step at 512K)
    with torch.autocast(device_type=batch.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None,
                        cache_enabled=False):
        extra = {} if getattr(batch, "real", None) is None else {"real": batch.real}  # (MoE: models/moe_stats.py)
        # (train.loss_weighting = sequence)
        if reduction == "sum" and getattr(batch, "label_weights", None) is not None:
            extra["label_weights"] = batch.label_weights
        if reduction == "sum" and getattr(batch, "scored", None) is not None:  # (the head over these rows only)
            extra["scored"] = batch.scored
        return model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction=reduction,
                     **extra)


def step_mean(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """A step's loss over the labels scored; with none, NaN (a mean over no token): the guard withholds the update
    on the device as for a non-finite loss (AdamW would move the weights with no data); train.on_nonfinite decides."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, total / count.clamp(min=1), float("nan"))
    return total / count if count else torch.full_like(total, float("nan"))
