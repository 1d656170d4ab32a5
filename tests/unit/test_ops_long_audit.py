"""Audit of the attention and loss ops (ops/) at the long lengths and awkward shapes short tests miss,
against an independent float64 reference written here (masked softmax attention by query blocks,
gradients by autograd; plain log-softmax cross-entropy):

- 8K-16K tokens, chunk sizes that do not divide the length and a last chunk of one token;
- packed documents: thousands of 1-token documents, one huge document beside tiny ones, documents
  starting exactly at a chunk boundary or ending one token after it;
- non-causal attention where some query documents are absent from the keys (rows that see no key:
  out 0, lse -inf, finite gradients, the lse gradient path included), also chunked;
- the varlen glue (ops/varlen.py rounds, cu_seqlens, merges) at that scale over a float64 fake of
  its CUDA kernels;
- merge_partials with lse -inf on either or both sides and lse gaps of 80+, fp32 and bf16 inputs;
  bf16 chunked attention whose error stays bf16 rounding (lse and merges in fp32);
- the chunked loss at 16K tokens with ignored chunks, and labels that are neither ids nor -100;
- no S x S tensor at 16K on the document-sparse and chunked paths.
"""

import numpy as np
import pytest
import torch

from longctx.ops import grouped, varlen
from longctx.ops.attention import attention, attention_forward, merge_partials
from longctx.ops.chunked import ChunkedLocalCore, ChunkGrid, chunked_attention, chunked_forward
from longctx.ops.loss import lm_head_loss, lm_head_token_scores
from probes import LargestOutput

NEG_INF = float("-inf")


def _reference(q, k, v, q_doc=None, k_doc=None, causal=True, dout=None, dlse=None, block=1024):
    """float64 attention by blocks of queries, each against the key columns it can see: (out, lse) or,
    with dout (and dlse), (out, lse, (dq, dk, dv)) of sum(out * dout) + sum(lse * dlse) by autograd.
    Rows that see no key: out 0, lse -inf (and no lse gradient)."""
    b, sq, h, d = q.shape
    sk, group = k.shape[1], h // k.shape[2]
    grad = dout is not None
    kd, vd = (t.detach().double().requires_grad_(grad) for t in (k, v))
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.zeros(b, h, sq, dtype=torch.float64)
    dq = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for s in range(0, sq, block):
        e = min(s + block, sq)
        mask = torch.ones(b, e - s, sk, dtype=torch.bool)
        if causal:
            mask &= (torch.arange(s, e)[:, None] >= torch.arange(sk)[None, :])[None]
        if q_doc is not None:
            mask &= q_doc[:, s:e, None] == k_doc[:, None, :]
        cols = mask.any(1).any(0).nonzero()
        lo, hi = (int(cols.min()), int(cols.max()) + 1) if len(cols) else (0, 1)
        mask = mask[:, None, :, lo:hi]
        qb = q[:, s:e].detach().double().requires_grad_(grad)
        kb, vb = (t[:, lo:hi].repeat_interleave(group, 2) for t in (kd, vd))
        scores = torch.einsum("bqhd,bkhd->bhqk", qb, kb).mul(d ** -0.5).masked_fill(~mask, NEG_INF)
        rows_lse = torch.logsumexp(scores, -1)
        seen = torch.isfinite(rows_lse)
        p = torch.exp(scores - torch.where(seen, rows_lse, 0.0)[..., None]).masked_fill(~mask, 0.0)
        o = torch.einsum("bhqk,bkhd->bqhd", p, vb)
        out[:, s:e], lse[:, :, s:e] = o.detach(), rows_lse.detach()
        if grad:
            loss = (o * dout[:, s:e].double()).sum()
            if dlse is not None:
                loss = loss + (torch.where(seen, rows_lse, 0.0) * dlse[:, :, s:e].double()).sum()
            loss.backward()
            dq[:, s:e] = qb.grad
    return (out, lse) if not grad else (out, lse, (dq, kd.grad, vd.grad))


def _docs(lengths) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))[None]


def _inputs(seq, heads=2, kv=1, d=8, seed=0, seq_k=None):
    g = torch.Generator().manual_seed(seed)
    seq_k = seq if seq_k is None else seq_k
    q, dout = (torch.randn(1, seq, heads, d, generator=g) for _ in range(2))
    k, v = (torch.randn(1, seq_k, kv, d, generator=g) for _ in range(2))
    return q, k, v, dout


def _rel(x, ref, scale=None) -> float:
    """Largest error relative to the reference's largest magnitude (dk, dv sum over thousands of rows), or
    to `scale` where the reference is zero in exact arithmetic."""
    denominator = ref.abs().max() if scale is None else scale
    return ((x.double() - ref).abs().max() / denominator.clamp(min=1e-30)).item()


def _check_paths(paths, q, k, v, dout, ref, tol=2e-5, zero_grads=False):
    """Each path's output and gradients against the reference. zero_grads: dq and dk are zero in exact
    arithmetic (every row sees only itself: a softmax over one key has no gradient), so theirs is measured
    against the gradients' scale, dv's largest magnitude: a kernel's rounding leaves ~1e-6 there (the CPU
    flash kernel's exp(s - lse) is 1 - eps), which relative to an exact 0 would read as 1e24."""
    ref_out, _, ref_grads = ref
    scales = [ref_grads[2].abs().max()] * 2 + [None] if zero_grads else [None] * 3
    failures = []
    for name, fn in paths.items():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        (out * dout).sum().backward()
        errors = [_rel(out, ref_out)] + [_rel(t.grad, r, scale) for t, r, scale in zip((qq, kk, vv), ref_grads, scales)]
        if max(errors) > tol or not all(torch.isfinite(t).all() for t in (out, qq.grad, kk.grad, vv.grad)):
            failures.append(f"{name}: out / dq / dk / dv relative errors {[f'{e:.1e}' for e in errors]}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------
# Causal attention at 8K tokens, chunked and document-sparse


LAYOUTS = {
    # 4097 tokens in chunks of 512: the last chunk is one token
    "one document, last chunk of 1 token": ([4097], 512),
    # a document of almost four chunks, then 600 one-token documents, then 3-token ones; chunk 777
    # divides nothing here
    "huge document beside tiny ones": ([3000] + [1] * 600 + [3] * 150 + [2], 777),
    # documents starting exactly at a chunk boundary (512, 1024, 2048, ...) or ending one token after it
    "boundaries at and one past chunk edges": ([512, 1, 511, 513, 511, 1024, 1025], 512),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_long_causal_attention_matches_float64(layout):
    lengths, chunk = LAYOUTS[layout]
    doc = _docs(lengths) if len(lengths) > 1 else None
    q, k, v, dout = _inputs(sum(lengths))  # 2 query heads on 1 kv head
    ref = _reference(q, k, v, doc, doc, dout=dout)
    with_doc = (lambda: None) if doc is None else doc.clone  # (a fresh tensor: no plan cached on it)
    paths = {"chunked": lambda a, b, c: ChunkedLocalCore(chunk)(a, b, c, with_doc()),
             "chunked, offload": lambda a, b, c: ChunkedLocalCore(chunk, True)(a, b, c, with_doc()),
             "flash": lambda a, b, c: attention(a, b, c, q_doc=doc, k_doc=doc)[0]}
    _check_paths(paths, q, k, v, dout, ref)


def test_two_rows_with_different_unsorted_documents():
    """Batch 2 of 2049 tokens, chunks of 512 (last one 1 token): row 0 one document; row 1 ids that are
    contiguous runs but neither sorted nor consecutive (9, 2, 40, 1-token ones counting down, 5), so a
    chunk pair can be visible in one row and not the other."""
    row1 = [300, 212, 1000] + [1] * 36 + [501]
    ids1 = np.repeat([9, 2, 40] + list(range(1000, 964, -1)) + [5], row1)
    doc = torch.stack([torch.zeros(2049, dtype=torch.long), torch.from_numpy(ids1)])
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 2049, 2, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2049, 1, 8, generator=g) for _ in range(2))
    ref = _reference(q, k, v, doc, doc, dout=dout)
    paths = {"chunked": lambda a, b, c: ChunkedLocalCore(512)(a, b, c, doc.clone()),
             "flash": lambda a, b, c: attention(a, b, c, q_doc=doc, k_doc=doc)[0]}
    _check_paths(paths, q, k, v, dout, ref)


def test_thousands_of_one_token_documents():
    """4K documents of one token: every row sees only itself (out = v of its kv head), in chunks of
    500 (last chunk 1 token) and unchunked on both backends."""
    q, k, v, dout = _inputs(4001)
    doc = _docs([1] * 4001)
    ref = _reference(q, k, v, doc, doc, dout=dout)
    paths = {"chunks of 500": lambda a, b, c: ChunkedLocalCore(500)(a, b, c, doc.clone())}
    for backend in ("flash", "math"):
        paths[backend] = lambda a, b, c, backend=backend: attention(a, b, c, q_doc=doc, k_doc=doc, backend=backend)[0]
    assert ref[2][0].abs().max() == ref[2][1].abs().max() == 0  # (the reference's dq and dk: exactly 0)
    _check_paths(paths, q, k, v, dout, ref, zero_grads=True)


@pytest.mark.slow
def test_16k_tokens_chunked_and_sparse_match_float64_without_s_by_s_tensors():
    """16K tokens: a 10K-token document, 2000 one-token ones, 7-token ones, the rest; chunks of 1000
    (last one 384 tokens). Results match the reference, and no op outputs anything near S x S."""
    lengths = [10000] + [1] * 2000 + [7] * 626
    lengths.append(16384 - sum(lengths))
    doc = _docs(lengths)
    q, k, v, dout = _inputs(16384)
    ref = _reference(q, k, v, doc, doc, dout=dout)
    paths = {"chunked": lambda a, b, c: ChunkedLocalCore(1000)(a, b, c, doc.clone()),
             "flash": lambda a, b, c: attention(a, b, c, q_doc=doc, k_doc=doc)[0]}
    with LargestOutput() as probe:
        _check_paths(paths, q, k, v, dout, ref)
    assert probe.largest < 16384 * 16384 // 100, probe.largest  # measured: 262,144 elements (0.001 S^2)


# ------------------------------------------------------------------------------------------------
# Non-causal attention with query documents the keys do not hold


def _cross_case():
    q_lengths, q_ids = [500, 1, 1000, 1, 999], [7, 3, 9, 11, 2]
    k_lengths, k_ids = [750, 1, 749], [9, 7, 2]  # documents 3 and 11 have no key: rows that see nothing
    q_doc = torch.from_numpy(np.repeat(q_ids, q_lengths))[None]
    k_doc = torch.from_numpy(np.repeat(k_ids, k_lengths))[None]
    return q_doc, k_doc, _inputs(sum(q_lengths), seq_k=sum(k_lengths))


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_rows_without_keys_give_zero_minus_inf_and_finite_gradients(backend):
    q_doc, k_doc, (q, k, v, dout) = _cross_case()
    dlse = torch.randn(1, 2, q.shape[1], generator=torch.Generator().manual_seed(1))
    ref_out, ref_lse, ref_grads = _reference(q, k, v, q_doc, k_doc, causal=False, dout=dout, dlse=dlse)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qq, kk, vv, causal=False, q_doc=q_doc, k_doc=k_doc, backend=backend)
    seen = torch.isfinite(lse)
    assert torch.equal(seen, torch.isfinite(ref_lse)) and not torch.isnan(lse).any()
    assert torch.all(lse[~seen] == NEG_INF) and torch.all(out.transpose(1, 2)[~seen] == 0)
    ((out * dout).sum() + (torch.where(seen, lse, 0.0) * dlse).sum()).backward()
    assert _rel(out, ref_out) < 2e-5 and _rel(torch.where(seen, lse, 0.0), torch.where(seen, ref_lse, 0.0)) < 2e-6
    for t, r in zip((qq, kk, vv), ref_grads):
        assert torch.isfinite(t.grad).all() and _rel(t.grad, r) < 2e-5
    assert torch.all(qq.grad.transpose(1, 2)[~seen] == 0)


def test_lse_gradient_path_matches_float64_without_s_by_s_tensors():
    """A gradient into the lse (the flash kernels take none) ran the math backward in one piece: at 5000
    tokens and 2 heads its largest tensor was [1, 2, S, S] (2.0 S^2 elements; 2 GiB of fp32 at 16K),
    measured 2.0 S^2 at 16K plain and 0.75 S^2 with a 10K-token document. By blocks of 1024 query rows
    now: 2 x 1024 x S here (0.4 S^2), 0.125 S^2 at 16K. Causal, one document, GQA (2 heads on 1);
    blocks with documents: test_rows_without_keys_give_zero_minus_inf_and_finite_gradients."""
    q, k, v, dout = _inputs(5000)
    dlse = torch.randn(1, 2, q.shape[1], generator=torch.Generator().manual_seed(3))
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout=dout, dlse=dlse)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with LargestOutput() as probe:
        out, lse = attention(qq, kk, vv)
        ((out * dout).sum() + (lse * dlse).sum()).backward()
    assert probe.largest < q.shape[1] ** 2, probe.largest
    for t, r in zip((qq, kk, vv), ref_grads):
        assert _rel(t.grad, r) < 2e-5


@pytest.mark.parametrize("chunk", [500, 377])
def test_chunked_cross_attention_with_absent_documents(chunk):
    q_doc, k_doc, (q, k, v, dout) = _cross_case()
    grid = ChunkGrid(np.arange(q.shape[1])[None], np.arange(k.shape[1])[None], q_doc.numpy(), k_doc.numpy(), chunk,
                     False)
    ref = _reference(q, k, v, q_doc, k_doc, causal=False, dout=dout)
    _check_paths({"chunked": lambda a, b, c: chunked_attention(a, b, c, grid)}, q, k, v, dout, ref)
    _, lse = chunked_forward(q, k, v, grid)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref[1])) and not torch.isnan(lse).any()


# ------------------------------------------------------------------------------------------------
# The varlen glue at scale, over a float64 fake of its kernels (written from their contract)


def _fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double().repeat_interleave(group, 1)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(), NEG_INF)
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[k0:k1].double().repeat_interleave(group, 1))
    return out.to(q.dtype), lse.float()


def _fake_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """By autograd on the float64 forward, with the GIVEN lse: d/dq,k,v of sum(dout * P V) where P =
    exp(S - lse), plus the row term -rowsum(dout * out) that normalisation by that lse contributes."""
    group, kvh = q.shape[1] // k.shape[1], k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        qs, ks, vs = (t.double().requires_grad_() for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        with torch.enable_grad():  # (the glue calls its kernels under no_grad)
            s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(group, 1)) * scale
            if causal:
                s = s.masked_fill(~torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(), NEG_INF)
            p = torch.exp(s - lse[:, q0:q1].double()[..., None])
            do = dout[q0:q1].double()
            row = (do * out[q0:q1].double()).sum(-1).T  # [h, q]
            f = (torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(group, 1)) * do).sum() - (p.sum(-1) * row).sum()
            g = torch.autograd.grad(f, (qs, ks, vs))
        dq[q0:q1] += g[0]
        dk[k0:k1] += g[1]
        dv[k0:k1] += g[2]
    assert dk.shape[1] == kvh
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def test_varlen_glue_with_tiny_and_huge_documents(monkeypatch):
    monkeypatch.setattr(varlen, "available", lambda t: True)
    monkeypatch.setattr(varlen, "_kernel_forward", _fake_forward)
    monkeypatch.setattr(varlen, "_kernel_backward", _fake_backward)
    lengths = [1] * 400 + [1700] + [2] * 150 + [1]
    doc = _docs(lengths)
    q, k, v, dout = _inputs(sum(lengths))
    ref = _reference(q, k, v, doc, doc, dout=dout)
    _check_paths({"varlen": lambda a, b, c: attention(a, b, c, q_doc=doc, k_doc=doc)[0]}, q, k, v, dout, ref)


# ------------------------------------------------------------------------------------------------
# Log-sum-exp merges


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_partials_with_empty_sides_and_far_apart_lse(dtype):
    g = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(1, 7, 2, 4, generator=g).to(dtype) for _ in range(2))
    # per row: both empty, a empty, b empty, a 90 above b, b 130 above a, equal, both huge
    lse_a = torch.tensor([NEG_INF, NEG_INF, 0.0, 100.0, -50.0, 3.0, 1e4]).expand(1, 2, 7)
    lse_b = torch.tensor([NEG_INF, 1.0, NEG_INF, 10.0, 80.0, 3.0, 1e4 - 85]).expand(1, 2, 7)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    a, b = lse_a.double(), lse_b.double()
    total = torch.logaddexp(a, b)
    safe = torch.where(torch.isinf(total), 0.0, total)
    ref = (out_a.double() * torch.exp(a - safe).transpose(1, 2)[..., None]
           + out_b.double() * torch.exp(b - safe).transpose(1, 2)[..., None])
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(total)) and not torch.isnan(out).any()
    assert torch.all(out[:, 0] == 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse[..., 1:].double(), total[..., 1:], rtol=1e-7, atol=1e-6)


def test_bf16_chunked_attention_error_is_bf16_rounding():
    """bf16 q, k, v at 4K tokens in chunks of 4096 down to 256 (16 merges per row at the end; 16 gave the
    same in a probe): the error against float64 stays that of rounding each partial and the result to
    bf16 (measured 4.8e-3 for every chunk size, the bare rounding of the reference 3.3e-3), and the lse
    stays fp32-accurate (5e-5): merges run in fp32, nothing accumulates in bf16."""
    q, k, v, _ = _inputs(4096, heads=2, kv=2)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    ref_out, ref_lse = _reference(q, k, v)
    pos = np.arange(4096)[None]
    bound = 2 * (ref_out.bfloat16().double() - ref_out).abs().max().item()  # rounding a partial, then the sum
    for chunk in (4096, 512, 256):
        out, lse = chunked_forward(q, k, v, ChunkGrid(pos, pos, None, None, chunk, True))
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert (out.double() - ref_out).abs().max().item() < bound, chunk
        assert (lse.double() - ref_lse).abs().max().item() < 2e-4, chunk
    dense_out, _ = attention_forward(q, k, v)
    assert (dense_out.double() - ref_out).abs().max().item() < bound


# ------------------------------------------------------------------------------------------------
# Chunked loss at 16K tokens


def test_chunked_loss_at_16k_tokens_with_ignored_chunks_matches_float64():
    """16K tokens in chunks of 1000 (last one 384 tokens), every label of chunks 3 and 7 ignored and
    scattered ones elsewhere: the sum and the mean (divided by the valid labels of all chunks) and the
    gradients match log-softmax cross-entropy in float64."""
    n, dim, vocab = 16384, 16, 301
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, dim, generator=g)
    w = torch.randn(vocab, dim, generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[3000:4000] = -100
    labels[7000:8000] = -100
    labels[::13] = -100
    valid = labels != -100
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    logp = torch.log_softmax(hd @ wd.T, -1)
    ref_sum = -(logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid).sum()
    ref_grads = torch.autograd.grad(ref_sum, (hd, wd))
    for reduction, divisor in (("sum", 1), ("mean", int(valid.sum()))):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = lm_head_loss(hh, ww, labels, chunk=1000, reduction=reduction)
        loss.backward()
        assert loss.item() == pytest.approx(ref_sum.item() / divisor, rel=1e-6)
        for t, r in zip((hh, ww), ref_grads):
            assert _rel(t.grad, r / divisor) < 1e-5
        assert torch.all(hh.grad[3000:4000] == 0) and torch.all(hh.grad[~valid] == 0)


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("bad", [-1, -2, 13])
def test_labels_that_are_neither_ids_nor_ignored_are_refused(chunk, bad):
    """The chunked loss gathered the target at labels.clamp(min=0): a label of -1 (another ignore
    convention) was silently scored as token 0 (loss 5.51 instead of an error), where the plain path's
    F.cross_entropy raises; lm_head_token_scores did the same on every path."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(40, 8, generator=g), torch.randn(13, 8, generator=g)
    labels = torch.randint(0, 13, (40,), generator=g)
    labels[5] = bad
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        lm_head_loss(h, w, labels, chunk=chunk)
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        lm_head_token_scores(h, w, labels, chunk=chunk)
    labels[5] = -100  # the one ignore label stays accepted
    assert torch.isfinite(lm_head_loss(h, w, labels, chunk=chunk))
    assert lm_head_token_scores(h, w, labels, chunk=chunk)[5].tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------------
# Grouped matmul: counts that do not cover the rows


@pytest.mark.parametrize("counts", [[3, 0, 5], [3, 0, 9]])
def test_grouped_mm_refuses_counts_that_do_not_sum_to_the_rows(counts):
    """torch._grouped_mm trusted the offsets: counts summing to 8 of 10 rows left rows 8-9 as
    uninitialised memory, counts summing to 12 read past x, both without an error (the loop path's split
    refuses them)."""
    if grouped.grouped_path(torch.ones(10, 8), torch.ones(3, 8, 8)) != "torch._grouped_mm":
        pytest.skip("this build's torch._grouped_mm has no CPU kernel")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g), torch.randn(3, 8, 8, generator=g)
    with pytest.raises(RuntimeError):
        grouped.grouped_mm(x, w, torch.tensor(counts))
    with grouped.use_loop(), pytest.raises(RuntimeError):
        grouped.grouped_mm(x, w, torch.tensor(counts))
    ref = torch.cat([x[:4] @ w[0], x[4:8] @ w[1], x[8:] @ w[2]])  # counts that fit still work
    torch.testing.assert_close(grouped.grouped_mm(x, w, torch.tensor([4, 4, 2])), ref)
