"""Shard / unshard full-sequence tensors in the balanced 2D layout.

Context group of size c (ring), head group of size h (all-to-all). The sequence is cut into 2c
equal chunks and context rank i holds chunks i and 2c-1-i ("zigzag"): under a causal mask the
early chunk has little to attend to and the late one a lot, so every context rank gets the same
work, and in every ring step after the first, exactly half of the block is needed (ring.py skips
the other half). Inside a head group, the context rank's part is cut again into h contiguous
pieces, one per head rank, so the all-to-all can gather it back in order.

Tokens, labels, positions and document ids all go through `shard_sequence`, so RoPE positions
and document masks stay attached to their tokens under any layout.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import comm


def _degrees(mesh) -> tuple[int, int, int, int]:
    """(ctx, head, ctx_rank, head_rank) of this process in `mesh` (None = one process)."""
    if mesh is None:
        return 1, 1, 0, 0
    c, h = mesh["ctx"].size(), mesh["head"].size()
    return c, h, mesh["ctx"].get_local_rank(), mesh["head"].get_local_rank()


def check_divisible(seq_len: int, ctx: int, head: int) -> None:
    unit = 2 * ctx * head
    if seq_len % unit:
        lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by 2 x ctx x head = 2 x {ctx} x {head} = {unit}, which "
            f"the balanced (zigzag) layout needs; use {lower or upper} or {upper}, or pad explicitly "
            f"(padding must be masked out of the loss)."
        )


def shard_indices(seq_len: int, ctx: int, head: int, ctx_rank: int, head_rank: int) -> torch.Tensor:
    """Global positions of the tokens this rank holds, in local order."""
    check_divisible(seq_len, ctx, head)
    chunk = seq_len // (2 * ctx)
    early = torch.arange(ctx_rank * chunk, (ctx_rank + 1) * chunk)
    late = torch.arange((2 * ctx - 1 - ctx_rank) * chunk, (2 * ctx - ctx_rank) * chunk)
    ctx_local = torch.cat([early, late])
    piece = ctx_local.numel() // head
    return ctx_local[head_rank * piece:(head_rank + 1) * piece]


def shard_sequence(x: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (identical on all ranks of the head x ctx group)."""
    c, h, i, j = _degrees(mesh)
    if c == h == 1:
        return x
    idx = shard_indices(x.shape[seq_dim], c, h, i, j).to(x.device)
    return x.index_select(seq_dim, idx)


def unshard_sequence(local: torch.Tensor, mesh, seq_dim: int = 1) -> torch.Tensor:
    """Exact inverse of shard_sequence: every rank gets the full sequence back (communicates)."""
    c, h, _, _ = _degrees(mesh)
    if c == h == 1:
        return local
    gathered = comm.all_gather(local, mesh["head"], label="unshard")           # [h, ...]
    gathered = torch.cat(list(gathered.unbind(0)), dim=seq_dim)                # context rank's part
    gathered = comm.all_gather(gathered, mesh["ctx"], label="unshard")         # [c, ...]
    gathered = torch.cat(list(gathered.unbind(0)), dim=seq_dim)
    seq_len = local.shape[seq_dim] * c * h
    order = torch.cat([shard_indices(seq_len, c, h, i, j) for i in range(c) for j in range(h)]).to(local.device)
    out = torch.empty_like(gathered)
    return out.index_copy_(seq_dim, order, gathered)
