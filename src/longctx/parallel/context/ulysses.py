"""Head-parallel all-to-all (DeepSpeed-Ulysses style) over the `head` mesh dim, with backward.

seq_to_head: [batch, seq/h, heads, d] (sequence-sharded) -> [batch, seq, heads/h, d] (head-sharded);
head_to_seq is its inverse. The backward of one is the other.

GQA: the head group needs kv heads it can split. If kv_heads is a multiple of h, each rank gets
kv_heads/h of them. If h is a multiple of kv_heads, every kv head is replicated h/kv_heads times
("just enough": each rank then holds the one kv head its query heads use). Otherwise the heads
cannot be split consistently and `check_heads` (job/checks.py) says so.
"""

from __future__ import annotations

import torch

from ...job import comm


def kv_replication(kv_heads: int, head: int) -> int:
    """How many copies of each kv head the head group needs (1 when kv_heads splits evenly)."""
    return head // kv_heads if head > kv_heads else 1


def _seq_to_head(x: torch.Tensor, mesh, label: str) -> torch.Tensor:
    h = mesh.size()
    b, s, heads, d = x.shape
    chunks = x.reshape(b, s, h, heads // h, d).permute(2, 0, 1, 3, 4)      # [h dest, b, s, heads/h, d]
    out = comm.all_to_all(chunks, mesh, label)                              # [h src, b, s, heads/h, d]
    return out.permute(1, 0, 2, 3, 4).reshape(b, h * s, heads // h, d)


def _head_to_seq(x: torch.Tensor, mesh, label: str) -> torch.Tensor:
    h = mesh.size()
    b, hs, local_heads, d = x.shape
    chunks = x.reshape(b, h, hs // h, local_heads, d).permute(1, 0, 2, 3, 4)  # [h dest, b, s, heads/h, d]
    out = comm.all_to_all(chunks, mesh, label)                                 # [h src = head group, ...]
    return out.permute(1, 2, 0, 3, 4).reshape(b, hs // h, h * local_heads, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, label):
        ctx.mesh, ctx.label = mesh, label
        return _seq_to_head(x, mesh, label)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.mesh, ctx.label + "_bwd"), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, label):
        ctx.mesh, ctx.label = mesh, label
        return _head_to_seq(x, mesh, label)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.mesh, ctx.label + "_bwd"), None, None


def seq_to_head(x: torch.Tensor, mesh, label: str = "all_to_all") -> torch.Tensor:
    if mesh.size() == 1:
        return x
    return _SeqToHead.apply(x, comm.lane(mesh, "ulysses"), label)  # on its own process group


def head_to_seq(x: torch.Tensor, mesh, label: str = "all_to_all") -> torch.Tensor:
    if mesh.size() == 1:
        return x
    return _HeadToSeq.apply(x, comm.lane(mesh, "ulysses"), label)
