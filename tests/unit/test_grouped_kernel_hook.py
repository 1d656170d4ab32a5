"""ops/grouped.py's kernel path hands back the kernel's own output, not a view of it: the identity Function that made
its backward's gradient contiguous returned `y.view_as(y)`, which FSDP2 saw as the experts' output ("FSDPExperts
returned a view tensor") and which refuses in-place writes. A hook on the output does the same job: the same
gradients as the loop over groups (an expanded gradient and an empty group included), the same saved bytes."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from longctx.models.moe_experts import swiglu_experts
from longctx.ops.grouped import _ContiguousGrad, cpu_kernel_available, grouped_mm, grouped_path, use_loop

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="this torch has no CPU torch._grouped_mm kernel")

COUNTS = ([3, 0, 5, 4], [0, 0, 12, 0], [12])  # an empty group, all rows in one group among empty ones, one group


def _leaves(counts, seed=0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), 8, generator=g).requires_grad_()
    w = torch.randn(len(counts), 12, 8, generator=g) if transposed else torch.randn(len(counts), 8, 12, generator=g)
    return x, w.requires_grad_(), torch.tensor(counts)


def _run(x, w, counts, transposed, upstream, path: str):
    """(output, x's gradient, w's gradient) on `path`: "kernel", "loop" or "identity" (the kernel followed by the
    contiguous-gradient identity Function the eager path ran before: what the hook replaced)."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    weight = w.transpose(1, 2) if transposed else w  # (the experts' [E, out, in] weights as [E, in, out] views)
    with use_loop() if path == "loop" else contextlib.nullcontext():  # (backward too: a recompute reads the switch)
        if path == "identity":
            y = _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=counts.cumsum(0).to(torch.int32)))
        else:
            assert grouped_path(x, weight) == ("loop (forced)" if path == "loop" else "torch._grouped_mm")
            y = grouped_mm(x, weight, counts)
        upstream(y).backward()
    return y, x.grad, w.grad


UPSTREAM = {"sum (an expanded gradient)": lambda y: y.sum(),
            "weighted": lambda y: (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(),
            "column-major": lambda y: (y.t().contiguous() ** 2).sum()}


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("upstream", list(UPSTREAM))
def test_kernel_output_is_no_view_and_its_gradients_are_unchanged(counts, transposed, upstream):
    x, w, c = _leaves(counts, transposed=transposed)
    y, gx, gw = _run(x, w, c, transposed, UPSTREAM[upstream], "kernel")
    assert y._base is None, "the kernel path returned a view of its output"
    assert "GroupedMm" in type(y.grad_fn).__name__  # the kernel's own node: no identity after it
    before = _run(x, w, c, transposed, UPSTREAM[upstream], "identity")
    assert before[0]._base is not None  # (the view FSDP2 warned about)
    assert all(torch.equal(a, b) for a, b in zip((y, gx, gw), before))
    if upstream != "column-major":  # (the loop's mm of a column-major gradient rounds otherwise: as before)
        assert all(torch.equal(a, b) for a, b in zip((y, gx, gw), _run(x, w, c, transposed, UPSTREAM[upstream],
                                                                         "loop")))


def test_no_grad_and_a_detached_input_still_run():
    x, w, c = _leaves([3, 0, 5, 4])
    with torch.no_grad():
        assert not grouped_mm(x, w, c).requires_grad
    y = grouped_mm(x.detach(), w, c)  # only the weight needs a gradient
    y.sum().backward()
    assert x.grad is None and w.grad is not None and torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


def _saved_bytes(fn) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        fn()
    return sum(saved)


def test_the_hook_saves_nothing_beyond_the_kernels_own_backward():
    x, w, c = _leaves([3, 0, 5, 4])
    offs = c.cumsum(0).to(torch.int32)
    assert _saved_bytes(lambda: grouped_mm(x, w, c)) == _saved_bytes(lambda: torch._grouped_mm(x, w, offs=offs))


@pytest.mark.parametrize("chunk", [0, 5])
def test_experts_swiglu_kernel_against_the_loop(chunk):
    """The experts' three grouped GEMMs, whole and in checkpointed pieces (memory.expert_chunk), `.sum()`-ed."""
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([4, 0, 7, 1])
    x = torch.randn(12, 8, generator=g)
    ws = [torch.randn(4, 16, 8, generator=g), torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 16, generator=g)]

    def run(loop):
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        with use_loop() if loop else contextlib.nullcontext():  # (backward too: the pieces' recompute reads it)
            y = swiglu_experts(leaves[0], counts, *leaves[1:], chunk=chunk)
            F.silu(y).sum().backward()
        return [y, *(t.grad for t in leaves)]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
