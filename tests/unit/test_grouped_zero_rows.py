"""ops/grouped.py: a grouped GEMM on no rows runs the loop, never the kernel, whose weight-gradient form with
a zero contraction length CUDA refuses under inductor (pytorch#192497); FlexMoE copy slots hit it every call
on a rank whose slots take no rows."""

import pytest
import torch

from longctx.ops import grouped


def test_no_rows_take_the_loop_and_give_zero_weight_gradients(monkeypatch):
    w = torch.randn(3, 16, 32, requires_grad=True)
    x = torch.randn(0, 16, requires_grad=True)
    if not grouped._kernel_fits(torch.randn(4, 16), w.detach()):
        pytest.skip("this torch has no CPU grouped_mm kernel: the guard is the kernel's")

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran on no rows")

    monkeypatch.setattr(grouped, "kernel_grouped_mm", refuse)
    y = grouped.grouped_mm(x, w, torch.zeros(3, dtype=torch.long))
    assert y.shape == (0, 32)
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))
    with pytest.raises(AssertionError, match="no rows"):  # rows still take the kernel
        grouped.grouped_mm(torch.randn(4, 16), w, torch.tensor([1, 2, 1]))
