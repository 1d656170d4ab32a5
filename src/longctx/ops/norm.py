"""RMSNorm as a function: the model's norm modules and the chunked loss (which recomputes the
final norm chunk by chunk) share one definition, so their numerics cannot drift apart."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), statistics in fp32, the result in x's dtype times weight's."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 statistics; fp64 stays fp64
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
