"""Grouped matrix multiply: rows of `x` grouped by expert, each group times its own weight.

`grouped_mm(x, w, counts)`: x [n, in] with the rows of group g contiguous (counts[g] of them, in
group order), w [groups, in, out] -> [n, out]. One interface, two paths:
- `torch._grouped_mm` (one kernel for every group, no host read of the counts) on CUDA, where the
  build has it and the shapes meet its alignment (16-byte strides, bf16);
- elsewhere a loop over the groups (CPU, fp32): the counts are read on the host, which costs
  nothing there. Both are deterministic; the loop is the reference the kernel is tested against.
"""

from __future__ import annotations

import torch


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 == w.dtype
            and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[n, in] x [groups, in, out] -> [n, out]; rows grouped by `counts` [groups] (they sum to n)."""
    if _kernel_fits(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    sizes = counts.tolist()
    parts = [rows @ w[g] for g, rows in enumerate(x.split(sizes)) if sizes[g]]
    if not parts:  # no rows at all: w stays in the graph (a zero gradient, as on every other rank)
        return x.new_zeros(0, w.shape[-1]) + 0 * w.sum()
    # w[g] slices one tensor, so w gets one dense gradient (zeros for the groups without rows)
    return torch.cat(parts)
