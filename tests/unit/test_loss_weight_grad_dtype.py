"""The chunked LM head's weight gradient under bf16 autocast (ops/loss.py _add_weight_grad): the product of a
chunk is the compute dtype's matmul (an fp32 one was ~10x slower on a GPU, 9 us of llama3-1b's ~46 us a
token), added to the fp32 gradient; taken in vocabulary row pieces where [vocab, dim] would outgrow the chunk's
freed fp32 logits gradient. Held to plain autograd of the same autocast linear (whose weight gradient is that
bf16 matmul, in one piece), and to float64."""

import pytest
import torch
import torch.nn.functional as F

from longctx.ops.loss import _add_weight_grad, lm_head_loss


def _data(n=256, d=48, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return h, w, labels


@pytest.mark.parametrize("chunk", [8, 64])  # 8: dim x 2 > 4 x chunk, the product in row pieces
def test_bf16_chunked_weight_gradient_matches_autograd_of_the_autocast_linear(chunk):
    h, w, labels = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = lm_head_loss(h, w, labels, chunk=chunk, reduction="sum")
    dw = torch.autograd.grad(ours, w)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
    ref = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    dw_ref = torch.autograd.grad(ref, w)[0]
    exact = torch.autograd.grad(F.cross_entropy(F.linear(h.double(), w.double()), labels, ignore_index=-100,
                                                reduction="sum"), w)[0]
    assert dw.dtype == torch.float32
    scale = exact.abs().max()
    # bf16 products summed over chunks in fp32: no further from float64 than the one bf16 product of autograd
    # (plus the chunks' own bf16 logits), and close to it
    err, err_ref = (dw.double() - exact).abs().max() / scale, (dw_ref.double() - exact).abs().max() / scale
    assert err < 2 * err_ref + 1e-3, (err, err_ref)
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=3e-2 * scale.item())


def test_row_pieces_equal_one_product():
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(16, 300, generator=g).to(torch.bfloat16)
    xn = torch.randn(16, 48, generator=g).to(torch.bfloat16)
    whole, pieces = torch.zeros(300, 48), torch.zeros(300, 48)
    _add_weight_grad(whole, grad, xn, chunk=1024)  # one product
    _add_weight_grad(pieces, grad, xn, chunk=4)  # 4 x 4 x 300 // (48 x 2) = 50 rows a piece
    torch.testing.assert_close(pieces, whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, (grad.t() @ xn).float(), rtol=0, atol=0)


def test_no_fp32_matmul_in_the_backward_under_bf16_autocast():
    """Every matmul of the chunked head (forward, its backward's recomputed logits, both gradients) runs in
    bf16 under bf16 autocast: before, the weight gradient's was an fp32 [vocab, chunk] x [chunk, dim] one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    h, w, labels = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm_head_loss(h, w, labels, chunk=64, reduction="sum")
    with Matmuls() as seen:
        torch.autograd.grad(out, (h, w))
    # per chunk: the recomputed logits, the hidden gradient and the weight gradient
    assert len(seen.dtypes) == 3 * 4 and set(seen.dtypes) == {torch.bfloat16}, seen.dtypes
