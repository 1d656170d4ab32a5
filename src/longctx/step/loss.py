"""The loss forward of a training step: the summed loss over a batch's valid labels, under autocast."""

from __future__ import annotations

import torch


def forward_loss_sum(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The summed loss over the batch's valid label tokens (the caller normalises)."""
    with torch.autocast(device_type=batch.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        padding = {} if getattr(batch, "real", None) is None else {"real": batch.real}  # (MoE: models/moe_stats.py)
        return model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="sum",
                     **padding)
