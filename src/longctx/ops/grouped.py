"""Grouped matrix multiply: rows of `x` grouped by expert, each group times its own weight.

`grouped_mm(x, w, counts)`: x [n, in] with the rows of group g contiguous (counts[g] of them, in
group order), w [groups, in, out] -> [n, out]. One interface, two paths:
- `torch._grouped_mm`: one operation for every group, whatever their number, and no host read of
  the counts. On CUDA where the build has it and the operands are bf16; on the CPU where the build
  has a CPU kernel (it loops over the groups inside the one operation: the same products as the
  loop below, the same bits), for fp32, bf16 and fp16. Both need 16-byte-aligned rows (in and out
  multiples of 8 bf16 or 4 fp32 values);
- elsewhere (fp64, unaligned widths, a build without the kernel) a loop over the groups: the counts
  are read on the host and every group is its own matmul, so the number of operations grows with
  the groups. Both are deterministic; the loop is the reference the kernel is tested against
  (`use_loop` forces it).
"""

from __future__ import annotations

import contextlib

import torch

from .eager import eager_under_compile

_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_cpu_kernel: bool | None = None  # cpu_kernel_available's answer, once asked


@eager_under_compile  # (run eagerly: traced, fp32 operands fail the kernel's bf16-only meta function)
def _probe_cpu_kernel() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 4), torch.ones(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def cpu_kernel_available() -> bool:
    """Whether this build's torch._grouped_mm runs on the CPU (it does from about torch 2.9 on)."""
    global _cpu_kernel
    if _cpu_kernel is None:
        _cpu_kernel = _probe_cpu_kernel()
    return _cpu_kernel


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows of 16 bytes' multiples, as the kernel requires of its operands' and output's strides."""
    per_16_bytes = 16 // x.element_size()
    return x.shape[-1] % per_16_bytes == 0 and w.shape[-1] % per_16_bytes == 0


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    if x.dtype != w.dtype or not _aligned(x, w):
        return False
    if x.is_cuda:
        return hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16
    return x.device.type == "cpu" and x.dtype in _CPU_KERNEL_DTYPES and cpu_kernel_available()


def grouped_path(x: torch.Tensor, w: torch.Tensor) -> str:
    """Which path grouped_mm takes for these operands, in words (for benchmarks' JSON)."""
    return "loop (forced)" if _FORCE_LOOP else "torch._grouped_mm" if _kernel_fits(x, w) else "loop"


def _contiguous(grad: torch.Tensor | None) -> torch.Tensor | None:
    """torch._grouped_mm's backward refuses an expanded gradient (the gradient of a `.sum()`: strides 0)."""
    if grad is None:  # (the hook's only: the output's gradient undefined, a Function having returned None for it)
        return None  # (a hook may not replace None; the kernel's backward takes it as zero: no gradient of x or w)
    # (an empty tensor counts as contiguous whatever its strides: an expanded one keeps its zero strides)
    return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient (_contiguous): the traced form only. Its
    output is a view of its input (a Function returning its input returns a view of it), which is why eager
    code hooks the kernel's output instead (kernel_grouped_mm)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return _contiguous(grad)


def kernel_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's contract: `offs` are the int32 END offsets of the groups (cumulative row
    counts); the last equals n. (The CPU runs it for 16-byte-aligned shapes: the glue is tested there.)"""
    offs = counts.cumsum(0).to(torch.int32)
    # The kernel trusts offs: rows past offs[-1] come back as uninitialised memory, and offsets past n
    # read beyond x, both silently (the loop's split refuses such counts). Checked on the device: no host read.
    torch._assert_async(offs[-1] == x.shape[0], "grouped_mm: the group counts must sum to the rows of x")
    y = torch._grouped_mm(x, w, offs=offs)
    if torch.compiler.is_compiling():  # Dynamo refuses a hook whose result depends on strides (torch 2.13)
        return _ContiguousGrad.apply(y)
    # Eager: a hook on the kernel's own output, not an identity Function, whose output would be a view: FSDP2
    # warned "FSDPExperts returned a view tensor" where it was the experts' output, and a view a Function
    # returned refuses in-place writes. The same gradients, no copy of the output, no extra autograd node.
    if y.requires_grad:
        y.register_hook(_contiguous)
    return y


# Under torch.compile the kernel is traced through its meta function, which (torch 2.13) accepts bf16
# operands only: fp32 and fp16 ones run it eagerly, between the compiled graphs around it.
_eager_kernel_grouped_mm = eager_under_compile(kernel_grouped_mm)


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
    # no rows runs the loop (no products; zero gradients of w): the kernel's weight-gradient form with a zero
    # contraction length is refused on CUDA where inductor emits it (pytorch#192497), and a rank's FlexMoE copy
    # slots run on no rows whenever its slots are empty or take none (parallel/expert/placement.py)
    if not _FORCE_LOOP and x.shape[0] and _kernel_fits(x, w):
        if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
            return _eager_kernel_grouped_mm(x, w, counts)
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
