"""A MoE layer's routed experts (models/moe.py MoEFeedForward runs them): E SwiGLU experts as 3D weights, run
on rows grouped by expert as one grouped GEMM per projection (ops/grouped.py), in checkpointed pieces of
memory.expert_chunk rows when set; expert parallelism runs the same function on each rank's experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops.grouped import grouped_mm
from .moe_dispatch import TokenDispatcher


class Experts(nn.Module):
    """E SwiGLU experts as 3D weights, each expert's matrix stored as nn.Linear stores it ([out, in]):
    w1 (gate) and w3 (up) [E, hidden, dim], w2 (down) [E, dim, hidden]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.chunk = 0  # memory.expert_chunk: rows run (and recomputed) at a time; 0 = all at once

    def forward(self, x: torch.Tensor, counts: torch.Tensor, dispatcher: TokenDispatcher | None = None,
                beside=None):
        """x [n, dim]: rows grouped by expert, counts[e] of them for expert e, in expert order. The
        layer passes its dispatcher, which runs them (`run_experts`: all here on one device, each on
        its owner under expert parallelism); inside this module's call, so that its hooks (FSDP's
        gather of these weights) see every run. `beside`: see the dispatcher's run_experts_beside."""
        if beside is not None:
            return dispatcher.run_experts_beside(self, x, counts, beside)
        return self.run_here(x, counts) if dispatcher is None else dispatcher.run_experts(self, x, counts)

    def run_here(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert on this device (one device's dispatcher runs this)."""
        return swiglu_experts(x, counts, self.w1, self.w3, self.w2, self.chunk)


def _swiglu_grouped(x, counts, w1, w3, w2):
    t = lambda w: w.transpose(1, 2)  # noqa: E731  [E, in, out] views of the [E, out, in] weights
    h = F.silu(grouped_mm(x, t(w1), counts)) * grouped_mm(x, t(w3), counts)
    return grouped_mm(h, t(w2), counts)


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, chunk: int = 0) -> torch.Tensor:
    """The experts' SwiGLU on rows grouped by expert (counts[e] rows for expert e, in order).

    chunk > 0 (memory.expert_chunk): at most `chunk` rows at a time, each piece checkpointed, so the
    experts' intermediates (3 x hidden per row, the largest tensors of an MoE layer) never exist for
    more rows than that, however many rows arrive: under skewed routing a rank may receive every
    token of its expert group. The pieces are cut by row position (the row count is a shape), each
    piece's counts clipped from the cumulative counts on the device: no host read."""
    if not chunk or x.shape[0] <= chunk:
        return _swiglu_grouped(x, counts, w1, w3, w2)
    return torch.cat([checkpoint(_swiglu_grouped, x[start:stop], piece_counts, w1, w3, w2, use_reentrant=False)
                      for start, stop, piece_counts in row_pieces(x.shape[0], counts, chunk)])


def row_pieces(n: int, counts: torch.Tensor, chunk: int):
    """memory.expert_chunk's pieces of `n` rows grouped by `counts`: (start, stop, the rows of each group inside
    [start, stop)) for every `chunk` rows, each group's [end - count, end) clipped on the device (no host read)."""
    ends = counts.cumsum(0)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        yield start, stop, ends.clamp(start, stop) - (ends - counts).clamp(start, stop)
