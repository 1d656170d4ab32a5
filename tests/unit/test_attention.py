"""ops/attention.py: fused kernels against a plain softmax reference, forward, lse and backward."""

import math

import pytest
import torch

from longctx.ops.attention import attention, attention_backward, attention_forward


def reference(q, k, v, causal=True, q_doc=None, k_doc=None):
    """Textbook attention in float64 with autograd: softmax(QK^T / sqrt(d) + mask) V."""
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 2), vd.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(d)
    allowed = torch.ones(b, 1, sq, k.shape[1], dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(sq, k.shape[1], dtype=torch.bool).tril()
    if q_doc is not None:
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vd)
    return out, lse


def make(b=2, s=24, h=4, kv=2, d=16, requires_grad=True):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, kv, d, generator=gen)
    v = torch.randn(b, s, kv, d, generator=gen)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def docs(b=2, s=24):
    # document boundaries at different places in each row, including a 1-token document
    d = torch.zeros(b, s, dtype=torch.long)
    d[0, 5:] = 1
    d[0, 6:] = 2
    d[0, 17:] = 3
    d[1, 11:] = 1
    return d


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("batch", [1, 2])
def test_forward_backward_match_reference(backend, causal, with_docs, kv, batch):
    q, k, v = make(b=batch, kv=kv)
    qd = kd = docs()[:batch] if with_docs else None
    out, lse = attention(q, k, v, causal=causal, q_doc=qd, k_doc=kd, backend=backend)
    ref_out, ref_lse = reference(q, k, v, causal, qd, kd)
    assert lse.dtype == torch.float32 and lse.shape == (batch, 4, 24)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    gout = torch.randn_like(out)
    grads = torch.autograd.grad((out * gout).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * gout.double()).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_docs", [False, True])
def test_a_float64_model_runs_backward_on_the_default_backend(with_docs):
    """The CPU flash kernel's backward wants the lse in fp64 for fp64 inputs: it was always handed fp32, so a
    `.double()` model (a high-precision reference, gradcheck) failed in backward ("expected Double")."""
    q, k, v = (t.detach().double().requires_grad_() for t in make())
    qd = kd = docs() if with_docs else None
    out, _ = attention(q, k, v, q_doc=qd, k_doc=kd)
    ref_out, _ = reference(q, k, v, True, qd, kd)
    gout = torch.randn_like(out)
    grads = torch.autograd.grad((out * gout).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * gout).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)  # (the forward keeps its lse in fp32)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_gradient_through_lse(backend):
    """Ring attention merges with the lse, so a gradient flowing into lse must be right too."""
    q, k, v = make()
    out, lse = attention(q, k, v, backend=backend)
    ref_out, ref_lse = reference(q, k, v)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * w_out.double()).sum() + (ref_lse * w_lse.double()).sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)


def test_backward_from_global_lse_gives_block_share():
    """Split keys in two blocks; each block's backward, normalised by the GLOBAL out and lse,
    sums to the full gradient. This is the contract ring attention's backward relies on."""
    q, k, v = make(s=16, requires_grad=False)
    out, lse = attention_forward(q, k, v, causal=False)
    dout = torch.randn_like(out)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=False)
    halves = [slice(0, 8), slice(8, 16)]
    dq_sum = torch.zeros_like(dq)
    for sl in halves:
        bq, bk, bv = attention_backward(dout, q, k[:, sl], v[:, sl], out, lse, causal=False)
        dq_sum += bq
        torch.testing.assert_close(bk, dk[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bv, dv[:, sl], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq_sum, dq, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_query_that_sees_nothing_gives_zero_and_minus_inf_lse(backend):
    q, k, v = make(b=1, s=4, requires_grad=False)
    qd = torch.tensor([[0, 0, 1, 1]])
    kd = torch.tensor([[0, 0, 0, 0]])
    out, lse = attention_forward(q, k, v, causal=False, q_doc=qd, k_doc=kd, backend=backend)
    assert torch.all(out[:, 2:] == 0) and torch.all(lse[..., 2:] == float("-inf"))
    assert torch.all(torch.isfinite(out)) and torch.all(torch.isfinite(lse[..., :2]))
    dq, dk, dv = attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=False, q_doc=qd, k_doc=kd,
                                    backend=backend)
    assert torch.all(dq[:, 2:] == 0) and all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_bad_shapes_are_rejected():
    q, k, v = make(requires_grad=False)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="q_doc must be"):
        attention(q, k, v, q_doc=torch.zeros(2, 5, dtype=torch.long), k_doc=torch.zeros(2, 24, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, backend="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("with_docs", [False, True])
def test_cuda_kernels_match_reference(with_docs):
    q, k, v = (t.detach().cuda().requires_grad_() for t in make())
    qd = kd = docs().cuda() if with_docs else None
    out, lse = attention(q, k, v, q_doc=qd, k_doc=kd)
    ref_out, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), True, None if qd is None else qd.cpu(),
                                 None if kd is None else kd.cpu())
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=1e-4)
    gout = torch.randn_like(out)
    grads = torch.autograd.grad((out * gout).sum(), (q, k, v))
    qc, kc, vc = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    ro, _ = reference(qc, kc, vc, True, None if qd is None else qd.cpu(), None if kd is None else kd.cpu())
    ref_grads = torch.autograd.grad((ro * gout.cpu().double()).sum(), (qc, kc, vc))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.cpu().double(), r.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_equal_documents_back_to_back(backend, causal):
    """Equal documents tiling the batch run as one kernel call with no accumulators: still exact."""
    q, k, v = make(b=2, s=24, kv=2)
    doc = (torch.arange(24) // 8).expand(2, 24)
    out, lse = attention(q, k, v, causal=causal, q_doc=doc, k_doc=doc, backend=backend)
    ref_out, ref_lse = reference(q, k, v, causal, doc, doc)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * w.double()).sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)


def test_many_tiny_documents_are_few_kernel_calls(monkeypatch):
    """4,000 documents of 8 tokens: one batched call per distinct pair shape, not one per document."""
    import longctx.ops.attention as A

    calls = []
    real = A._dense_forward
    monkeypatch.setattr(A, "_dense_forward", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    q, k, v = make(b=1, s=32000, h=2, kv=1, d=8, requires_grad=False)
    doc = (torch.arange(32000) // 8)[None]
    doc[0, -5:] = 4000  # a short trailing document (padding)
    out, _ = attention_forward(q, k, v, causal=True, q_doc=doc, k_doc=doc)
    assert sorted(calls) == [1, 1, 3999]  # 3,999 documents of 8, one of 3 and the trailing one of 5
    ref, _ = attention_forward(q[:, :8], k[:, :8], v[:, :8], causal=True)
    torch.testing.assert_close(out[:, :8], ref)
