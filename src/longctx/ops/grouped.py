"""Grouped matrix multiply: rows of `x` grouped by expert, each group times its own weight.

`grouped_mm(x, w, counts)`: x [n, in] with the rows of group g contiguous (counts[g] of them, in
group order), w [groups, in, out] -> [n, out]. One interface, two paths:
- `torch._grouped_mm` (one kernel for every group, no host read of the counts) on CUDA, where the
  build has it and the shapes meet its alignment (16-byte strides, bf16);
- elsewhere a loop over the groups (CPU, fp32): the counts are read on the host, which costs
  nothing there. Both are deterministic; the loop is the reference the kernel is tested against.
"""

from __future__ import annotations

import contextlib

import torch


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 == w.dtype
            and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


def kernel_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's contract: `offs` are the int32 END offsets of the groups (cumulative row
    counts); the last equals n. (Runs on CPU too for 16-byte-aligned shapes: the glue is tested there.)"""
    return torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[n, in] x [groups, in, out] -> [n, out]; rows grouped by `counts` [groups] (they sum to n)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # cast as autocast casts a matmul's operands, BEFORE the kernel check: one GPU trains fp32
        # weights under bf16 autocast (no FSDP gathers them in bf16), and the kernel wants bf16
        dtype = torch.get_autocast_dtype(device)
        x, w = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (x, w))
        with torch.autocast(device, enabled=False):
            return _grouped(x, w, counts)
    return _grouped(x, w, counts)


_FORCE_LOOP = False  # the benchmark's switch (use_loop): the reference path where the kernel would run


@contextlib.contextmanager
def use_loop():
    """Run the loop over groups even where the kernel fits (to time or check one against the other)."""
    global _FORCE_LOOP
    before, _FORCE_LOOP = _FORCE_LOOP, True
    try:
        yield
    finally:
        _FORCE_LOOP = before


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if not _FORCE_LOOP and _kernel_fits(x, w):
        return kernel_grouped_mm(x, w, counts)
    # no rows at all still runs the Function: its output must stay a function of x as well as w, so
    # that backward reaches whatever produced x (under expert parallelism, an all-to-all every rank joins)
    return _LoopedGroupedMM.apply(x, w, counts.tolist())


def _column_major(t: torch.Tensor) -> bool:
    """The test autograd's mm backward makes on an operand (FunctionsManual.cpp, mm_mat*_backward)."""
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


class _LoopedGroupedMM(torch.autograd.Function):
    """The loop over groups with every product written in place: the output, the gradient of x and
    the gradient of w are each one allocation, filled group by group. The same products as a loop
    of `rows @ w[g]` under autograd (forward, and backward as mm's backward computes them, layout rule
    included), so the same bits, without the concatenation of the parts, the concatenation of
    their input gradients and a full-size zero-filled gradient of w per group."""

    @staticmethod
    def forward(ctx, x, w, sizes):
        out = x.new_empty(x.shape[0], w.shape[-1])
        for g, (rows, dst) in enumerate(zip(x.split(sizes), out.split(sizes))):
            if sizes[g]:
                torch.mm(rows, w[g], out=dst)
        ctx.save_for_backward(x, w)
        ctx.sizes = sizes
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        sizes = ctx.sizes
        gx = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # laid out as mm's backward lays out each w[g]'s gradient
            wt = _column_major(w[0])
            gw = w.new_empty(w.shape[0], w.shape[2], w.shape[1]) if wt else w.new_empty(w.shape)
        start = 0
        for g, n in enumerate(sizes):
            if not n:
                if gw is not None:
                    gw[g].zero_()
                continue
            rows, dy, wg = x[start:start + n], grad[start:start + n], w[g]
            if gx is not None:
                if _column_major(rows):  # (never for the rows of a contiguous x; as mm's backward does)
                    gx[start:start + n] = wg.mm(dy.t()).t()
                else:
                    torch.mm(dy, wg.t(), out=gx[start:start + n])
            if gw is not None:
                if wt:
                    torch.mm(dy.t(), rows, out=gw[g])
                else:
                    torch.mm(rows.t(), dy, out=gw[g])
            start += n
        if gw is not None and wt:
            gw = gw.transpose(1, 2)
        return gx, gw, None
