"""Activation recomputation policies applied to a model's blocks without renaming any module.

`full`: each block keeps only its input for backward and recomputes the rest
(torch.utils.checkpoint, non-reentrant). The wrapper replaces the block's bound `forward`, so
parameter names (`layers.3.attention.wq.weight`) stay the same for checkpoints and HF export.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

POLICIES = ("none", "full")


def apply_recompute(layers: nn.ModuleList, policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy '{policy}' is not available; choose one of {POLICIES}")
    if policy == "none":
        return
    for block in layers:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
