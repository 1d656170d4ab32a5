"""A float64 model's attention is float64 throughout (ops/attention.py, ops/chunked.py).

The norm and the loss keep fp64 as fp64 (ops/norm.py, ops/loss.py: "fp64 stays fp64"), and fp64 runs
are what parity checks use as their reference; attention's statistics were fixed at fp32 instead: the
lse (every backend), the math backend's whole computation, the merges of partial results, and the
gradient accumulators of the document-sparse and chunked backwards. An fp64 model then carried fp32
rounding (measured before the fix: lse 2e-7 off, gradients 1e-7 to 2e-6 off the fp64 reference,
chunked vs unchunked losses of a 2-layer model 1.5e-9 apart) and torch.autograd.gradcheck failed on
the math backend, the lse and the chunked core. Now the statistics use promote_types(dtype, fp32):
fp32 for fp32 / bf16 / fp16 inputs (unchanged), fp64 for fp64.

Reference: each document's own causal softmax attention in float64 (autograd), concatenated.
"""

import math

import pytest
import torch

from longctx.ops.attention import attention, attention_forward, merge_partials
from longctx.ops.chunked import chunked_local_attention

F64 = torch.float64


def _docs(*rows):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])


def _reference(q, k, v, doc):
    """(out, lse) of per-document causal attention, each document on its own."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    outs, lses = [], []
    for r in range(b):
        ids = doc[r].tolist()
        row_out, row_lse, start = [], [], 0
        while start < s:
            end = start
            while end < s and ids[end] == ids[start]:
                end += 1
            qi, ki, vi = (t[r, start:end].transpose(0, 1) for t in (q, kk, vv))  # [h, n, d]
            scores = qi @ ki.transpose(1, 2) / math.sqrt(d)
            n = end - start
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            row_out.append((scores.softmax(-1) @ vi).transpose(0, 1))
            row_lse.append(scores.logsumexp(-1))
            start = end
        outs.append(torch.cat(row_out))
        lses.append(torch.cat(row_lse, dim=1))
    return torch.stack(outs), torch.stack(lses)


def _inputs(b, s, h, kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, dtype=F64, generator=g) for n in (h, kv, kv)] + \
        [torch.randn(b, s, h, d, dtype=F64, generator=g), torch.randn(b, h, s, dtype=F64, generator=g)]


PATHS = {
    "flash": lambda q, k, v, doc: attention(q, k, v, q_doc=doc, k_doc=doc),
    "math": lambda q, k, v, doc: attention(q, k, v, q_doc=doc, k_doc=doc, backend="math"),
    "flash_no_docs": lambda q, k, v, doc: attention(q, k, v),
}
LAYOUTS = {"packed": ((1, 7, 8, 3, 5), (16, 4, 4)), "one_document": ((24,), (24,))}


@pytest.mark.parametrize("path,layout", [(p, lay) for p in PATHS for lay in LAYOUTS
                                         if not (p == "flash_no_docs" and lay == "packed")])
def test_float64_attention_out_lse_and_gradients_are_float64_exact(path, layout):
    doc = _docs(*LAYOUTS[layout])
    q, k, v, dout, dlse = _inputs(2, 24, 6, 2, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = PATHS[path](*leaves, doc)
    assert lse.dtype == F64
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _reference(*refs, doc)
    ref_grads = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), refs)
    assert (out - ref_out).abs().max() < 1e-12  # was 4e-7 (math backend)
    assert (lse - ref_lse).abs().max() < 1e-12  # was 2e-7
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-11  # was 1e-7 (flash), 2e-6 (math)


@pytest.mark.parametrize("chunk", [5, 8, 100])
def test_float64_chunked_attention_is_float64_exact(chunk):
    doc = _docs((1, 7, 8, 3, 5), (16, 4, 4))
    q, k, v, dout, _ = _inputs(2, 24, 6, 3, 8, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = chunked_local_attention(*leaves, doc, chunk=chunk)
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = _reference(*refs, doc)[0]
    ref_grads = torch.autograd.grad((ref_out * dout).sum(), refs)
    assert (out - ref_out).abs().max() < 1e-12  # was 3e-7 (fp32 merges)
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-11  # was 4e-7


def test_float64_merge_of_two_key_halves_is_the_whole():
    q, k, v, _, _ = _inputs(1, 20, 4, 2, 8, seed=2)
    whole_out, whole_lse = attention_forward(q, k, v, causal=False)
    out_a, lse_a = attention_forward(q, k[:, :9], v[:, :9], causal=False)
    out_b, lse_b = attention_forward(q, k[:, 9:], v[:, 9:], causal=False)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert out.dtype == F64 and lse.dtype == F64
    assert (out - whole_out).abs().max() < 1e-13 and (lse - whole_lse).abs().max() < 1e-13  # were 3e-7, 5e-7


@pytest.mark.parametrize("path", ["math", "chunked", "lse"])
def test_float64_gradcheck(path):
    """gradcheck's finite differences (eps 1e-6) need fp64 forward values: failed on all three before."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))
    fn = {"math": lambda q, k, v: attention(q, k, v, backend="math")[0],
          "chunked": lambda q, k, v: chunked_local_attention(q, k, v, None, chunk=4),
          "lse": lambda q, k, v: attention(q, k, v)[1]}[path]
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precisions_keep_fp32_statistics(dtype):
    """Control: fp32 and bf16 inputs still get an fp32 lse and fp32 merges."""
    q, k, v, _, _ = _inputs(1, 12, 2, 1, 8, seed=4)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    doc = _docs((5, 7))
    for backend in ("flash", "math"):
        out, lse = attention_forward(q, k, v, q_doc=doc, k_doc=doc, backend=backend)
        assert out.dtype == dtype and lse.dtype == torch.float32
    merged, lse2 = merge_partials(out, lse, out, lse)
    assert merged.dtype == torch.float32 and lse2.dtype == torch.float32
