"""Which part of a parameter this rank holds, so weights are written shard by shard.

After FSDP2 (`fully_shard`) a parameter is a DTensor whose local tensor is one chunk of the global
one (torch.chunk rule: the first ranks get ceil(n / k) rows). These helpers let the model write its
initial weights, or read a Hugging Face tensor, into just that chunk, with no communication; on a
plain tensor they are the identity. Only torch's own DTensor type is used: models/ stays free of
longctx.parallel.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """Index of this rank's part of `p` in the global tensor (every dim; whole dims where unsharded)."""
    index = [slice(0, n) for n in p.shape]
    if not isinstance(p, DTensor):
        return tuple(index)
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"cannot locate a {placement} shard (only Shard and Replicate placements)")
        dim, ranks, r = placement.dim, p.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        start, stop = index[dim].start, index[dim].stop
        size = -(-(stop - start) // ranks)  # torch.chunk: ceil
        lo = min(start + r * size, stop)
        index[dim] = slice(lo, min(lo + size, stop))
    return tuple(index)


def local_part(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank writes into: the DTensor's local shard, or `p` itself."""
    return p.to_local() if isinstance(p, DTensor) else p


@torch.no_grad()
def write_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """p <- full (the global value), each rank copying only its own part."""
    local = local_part(p)
    local.copy_(full[local_slices(p)].to(local.dtype))
