"""One all_to_all_v in two autograd steps, so that what runs between them overlaps the transfer, in forward
and in backward (the expert-parallel dispatcher runs a MoE layer's shared experts there:
parallel/expert/dispatch.py run_experts_beside). Built on job/comm.py's all_to_all_v_async, the only
caller of torch.distributed."""

from __future__ import annotations

import torch

from .comm import PendingTransfer, all_to_all_v_async


class SplitTransfer:
    """One all_to_all_v cut in two autograd steps, StartAllToAllV and WaitAllToAllV: whatever autograd
    runs between them overlaps the transfer, in forward and (the reverse transfer) in backward.

        t = SplitTransfer(mesh, send_rows, recv_rows, label)
        token = StartAllToAllV.apply(x, t)   # issued
        s = other(...)                       # computed while x travels
        y = WaitAllToAllV.apply(token, t)    # x's rows arrived

    Backward runs them the other way round: WaitAllToAllV's backward issues the gradient's transfer back
    and StartAllToAllV's waits for it. The autograd engine runs a ready node with a higher sequence
    number first, so the backward of what was computed between the two forwards (issued after
    StartAllToAllV) runs between them too. Exact: the same rows, in the same order, as AllToAllV."""

    def __init__(self, mesh, send_rows: list[int], recv_rows: list[int], label: str):
        self.mesh, self.send_rows, self.recv_rows, self.label = mesh, send_rows, recv_rows, label
        self.forward: PendingTransfer | None = None
        self.backward: PendingTransfer | None = None


class StartAllToAllV(torch.autograd.Function):
    """SplitTransfer's first half: x's transfer issued; returns an empty tensor that orders the halves."""

    @staticmethod
    def forward(ctx, x, t: SplitTransfer):
        ctx.t = t
        # (detached: over one rank the "received" rows are x itself, which WaitAllToAllV returns as its own output)
        t.forward = all_to_all_v_async(x.detach(), t.mesh, t.send_rows, t.recv_rows, label=t.label)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        t = ctx.t
        grad, t.backward = t.backward.wait(), None
        return grad, None


class WaitAllToAllV(torch.autograd.Function):
    """SplitTransfer's second half: the received rows, once they have arrived."""

    @staticmethod
    def forward(ctx, token, t: SplitTransfer):
        ctx.t = t
        out, t.forward = t.forward.wait(), None
        return out

    @staticmethod
    def backward(ctx, grad):
        t = ctx.t
        t.backward = all_to_all_v_async(grad.contiguous(), t.mesh, t.recv_rows, t.send_rows, label=t.label)
        return grad.new_empty(0), None
