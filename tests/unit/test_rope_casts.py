"""RoPE without fp32 copies of q and k (models/llama.py apply_rope): the same values and gradients as rotating
x.float(), bit for bit, and no bf16 -> fp32 copy of q or k in its forward (the roofline audit of a training step,
benchmarks/step_roofline.py, counted two per forward of q and of k in every layer, forward and recompute)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.models.llama import apply_rope, rope_cos_sin


def _fp32_copy_rope(x, cos, sin):
    """The rotation as it was written: x and its rotation copied to fp32 first."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _tables(seq=24, head_dim=16):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return rope_cos_sin(torch.arange(seq)[None] * 37, inv)


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.upcasts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16 \
                and out.dtype == torch.float32:
            self.upcasts += 1
        return out


def test_rope_equals_fp32_copy_rotation_bitwise():
    cos, sin = _tables()
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.randn(2, 24, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        grad = torch.randn(2, 24, 3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
        x_new, x_old = base.clone().requires_grad_(), base.clone().requires_grad_()
        y_new, y_old = apply_rope(x_new, cos, sin), _fp32_copy_rope(x_old, cos, sin)
        assert y_new.dtype == dtype and torch.equal(y_new, y_old)
        y_new.backward(grad)
        y_old.backward(grad)
        assert torch.equal(x_new.grad, x_old.grad)


def test_rope_makes_no_fp32_copy_of_bf16_q_or_k():
    cos, sin = _tables()
    x = torch.randn(2, 24, 3, 16).bfloat16().requires_grad_()
    with _Casts() as casts:
        apply_rope(x, cos, sin).float().sum().backward()
    # two are left, neither RoPE's own: the test's .float() before the sum, and in backward the gradient of the
    # result's cast to bf16 (fp32 x copies made four: also x and its rotation in forward)
    assert casts.upcasts == 2


def test_rope_keeps_fp64_in_fp64():
    cos, sin = _tables()
    x = torch.randn(1, 24, 2, 16, dtype=torch.float64)
    ref = x * cos.double() + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin.double()
    assert torch.equal(apply_rope(x, cos, sin), ref)
