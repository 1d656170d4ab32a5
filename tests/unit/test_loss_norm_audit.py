"""Audit of the loss's normalisation (ops/loss.py): a mean over no valid label does not depend on
memory.loss_chunk. The plain path (chunk 0, or no more tokens than a chunk) used F.cross_entropy's own
mean, NaN with every label ignored, while the chunked path gives 0 with zero gradients
(test_loss.py's test_all_ignored_gives_zero_not_nan)."""

import pytest
import torch
import torch.nn.functional as F

from longctx.ops.loss import lm_head_loss


def _data(n=12, d=8, v=13):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.1).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, generator=g)).requires_grad_()
    return h, w, nw, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("chunk", [0, 12, 64, 5])
@pytest.mark.parametrize("with_norm", [False, True])
def test_mean_over_no_valid_label_is_zero_on_every_path(chunk, with_norm):
    h, w, nw, labels = _data()
    labels[:] = -100
    out = lm_head_loss(h, w, labels, chunk=chunk, reduction="mean", norm=(nw, 1e-5) if with_norm else None)
    out.backward()
    assert out.item() == 0.0
    for p in (h, w, nw) if with_norm else (h, w):
        assert p.grad is not None and torch.all(p.grad == 0)


@pytest.mark.parametrize("chunk", [0, 5])
def test_plain_and_chunked_means_agree_with_cross_entropy(chunk):
    h, w, _, labels = _data()
    labels[::3] = -100
    ref = F.cross_entropy(F.linear(h, w).double(), labels, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (h, w))
    out = lm_head_loss(h, w, labels, chunk=chunk, reduction="mean")
    grads = torch.autograd.grad(out, (h, w))
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-5, atol=1e-7)
