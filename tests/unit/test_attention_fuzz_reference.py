"""Randomized (seeded) comparison of the one-process attention paths with an independent dense reference.

Each example draws a batch of packed documents among the edge cases (one document, every token its
own, boundaries at chunk boundaries, a long document then tiny ones then padding, a mix of 1- and
2-token documents), grouped-query heads, chunk sizes that do and do not divide the tokens, and checks
outputs and the q, k, v gradients against tests/attention_reference.py (float64 textbook attention
built from the document ids) to 2e-5 in fp32:

- ops/attention.py `attention`, backends flash (CPU fused kernel per segment-pair group) and math;
- the same through ops/varlen.py's varlen glue (rounds, cu_seqlens, merges), its CUDA kernels
  replaced by a float64 fake written from their contract;
- ops/chunked.py's chunked core (memory.attention_chunk), with and without attention_offload;
- parallel/context/ring.py simulate_ring (zigzag blocks, plain ring and Double-Ring windows);
- non-causal attention of queries and keys with different document ids.

The multi-process paths (Ulysses x ring, Double-Ring, document layouts): tests/distributed/
test_attention_fuzz_layouts.py. Grouped-query shapes that cannot be split are refused (tested last).
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_reference import DOC_KINDS, dense_reference, doc_ids, doc_lengths
from longctx.errors import ConfigError
from longctx.job.checks import check_heads
from longctx.ops import varlen
from longctx.ops.attention import attention
from longctx.ops.chunked import ChunkedLocalCore
from longctx.parallel.context.ring import simulate_ring
from longctx.parallel.context.sequence import shard_indices

TOL = 2e-5
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _errors(out, grads, ref_out, ref_grads):
    return ((out.double() - ref_out).abs().max().item(),
            max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)))


def _run(fn, q, k, v, dout):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv)
    return out, torch.autograd.grad((out * dout).sum(), (qq, kk, vv))


@st.composite
def packed_batches(draw):
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, 40))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    chunk = draw(st.integers(1, seq + 2))
    rows = [doc_lengths(rng, seq, draw(st.sampled_from(DOC_KINDS)), share=chunk, chunk=chunk) for _ in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, n, 8, generator=gen) for n in (heads, kv, kv))
    dout = torch.randn(batch, seq, heads, 8, generator=gen)
    return dict(q=q, k=k, v=v, dout=dout, doc=doc_ids(rows, first_id=draw(st.sampled_from([0, 5]))), chunk=chunk,
                documents=draw(st.booleans()) or seq == 1, rows=rows)


def _fake_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """The varlen kernel's contract in float64: one softmax(q k^T * scale) v per (cu_q, cu_k) sequence."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
    for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double().repeat_interleave(g, 1)) * scale
        if causal:  # (square pairs: bottom-right and top-left alignment agree)
            s = s.masked_fill(~torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0)), float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[k0:k1].double().repeat_interleave(g, 1))
    return out.to(q.dtype), lse.float()


def _fake_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """Its backward from the GIVEN out and lse: P = exp(S - lse), dS = P (dP - rowsum(dout out))."""
    g, kvh = q.shape[1] // k.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk, dv = (torch.zeros(k.shape[0], q.shape[1], q.shape[2], dtype=torch.float64) for _ in range(2))
    for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        ke, ve = (t[k0:k1].double().repeat_interleave(g, 1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), ke) * scale
        if causal:
            s = s.masked_fill(~torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0)), float("-inf"))
        p = torch.exp(s - lse[:, q0:q1].double()[..., None])
        do = dout[q0:q1].double()
        ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - (do * out[q0:q1].double()).sum(-1).T[..., None])
        dv[k0:k1] += torch.einsum("hqk,qhd->khd", p, do)
        dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, ke) * scale
        dk[k0:k1] += torch.einsum("hqk,qhd->khd", ds, q[q0:q1].double()) * scale
    reduce = lambda t: t.view(-1, kvh, g, t.shape[-1]).sum(2).to(k.dtype)  # noqa: E731
    return dq.to(q.dtype), reduce(dk), reduce(dv)


@FUZZ
@given(packed_batches())
def test_local_and_chunked_attention_match_the_dense_reference(case):
    q, k, v, dout, chunk = case["q"], case["k"], case["v"], case["dout"], case["chunk"]
    doc = case["doc"] if case["documents"] else None
    ref_out, ref_grads = dense_reference(q, k, v, doc, dout)
    paths = {f"attention {b}": (lambda a, c, d, b=b: attention(a, c, d, q_doc=doc, k_doc=doc, backend=b)[0])
             for b in ("flash", "math")}
    for offload in (False, True):
        for size in (1, chunk):
            core = ChunkedLocalCore(size, offload)
            paths[f"chunks of {size}, offload {offload}"] = (
                lambda a, c, d, core=core: core(a, c, d, None if doc is None else doc.clone()))
    failures = []
    for name, fn in paths.items():
        errors = _errors(*_run(fn, q, k, v, dout), ref_out, ref_grads)
        if max(errors) > TOL:
            failures.append(f"{name}: out {errors[0]:.2e}, grads {errors[1]:.2e}")
    with pytest.MonkeyPatch.context() as mp:  # the varlen glue over a fake of its CUDA kernels
        mp.setattr(varlen, "available", lambda t: True)
        mp.setattr(varlen, "_kernel_forward", _fake_varlen_forward)
        mp.setattr(varlen, "_kernel_backward", _fake_varlen_backward)
        fn = lambda a, c, d: attention(a, c, d, q_doc=doc, k_doc=doc)[0]  # noqa: E731
        errors = _errors(*_run(fn, q, k, v, dout), ref_out, ref_grads)
        if max(errors) > TOL:
            failures.append(f"varlen: out {errors[0]:.2e}, grads {errors[1]:.2e}")
    assert not failures, f"documents {case['rows'] if doc is not None else None}:\n" + "\n".join(failures)


@FUZZ
@given(st.integers(0, 2 ** 31 - 1), st.sampled_from([(1, 0), (2, 0), (4, 0), (4, 2), (4, 1)]), st.integers(1, 3),
       st.sampled_from([(2, 1), (4, 2), (2, 2)]), st.booleans())
def test_simulated_ring_matches_the_dense_reference(seed, ctx_window, per_chunk, heads_kv, causal):
    ctx, window = ctx_window
    heads, kv = heads_kv
    seq = 2 * ctx * per_chunk
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, seq, n, 8, generator=gen) for n in (heads, kv, kv))
    dout = torch.randn(2, seq, heads, 8, generator=gen)
    ref_out, ref_grads = dense_reference(q, k, v, None, dout, causal=causal)
    outs, _, dqs, dks, dvs = simulate_ring(q, k, v, ctx, window, causal=causal, dout=dout)
    for rank in range(ctx):
        idx = shard_indices(seq, ctx, 1, rank, 0)
        shard = lambda t, idx=idx: t.index_select(1, idx)  # noqa: E731
        errors = _errors(outs[rank], (dqs[rank], dks[rank], dvs[rank]), shard(ref_out), [shard(g) for g in ref_grads])
        assert max(errors) <= TOL, (rank, errors)


@FUZZ
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 12), st.integers(1, 12), st.sampled_from([(2, 1), (2, 2)]))
def test_cross_attention_with_other_documents_matches_the_dense_reference(seed, seq_q, seq_k, heads_kv):
    """Non-causal, queries and keys with their own document ids: a query whose document has no key gets 0."""
    rng = np.random.default_rng(seed)
    q_doc = doc_ids([doc_lengths(rng, seq_q, "mixed")], first_id=int(rng.integers(0, 3)))
    k_doc = doc_ids([doc_lengths(rng, seq_k, "mixed")], first_id=int(rng.integers(0, 3)))
    heads, kv = heads_kv
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, seq_q, heads, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, seq_k, kv, 8, generator=gen) for _ in range(2))
    # the reference's mask for different query and key ids, over a [seq_q, seq_k] score matrix
    qd, kd = (t.double().requires_grad_() for t in (q, k))
    vd = v.double().requires_grad_()
    g = torch.arange(heads) // (heads // kv)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd[:, :, g]) / 8 ** 0.5
    s = s.masked_fill(~(q_doc[:, None, :, None] == k_doc[:, None, None, :]), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))  # rows without a key: 0
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vd[:, :, g])
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), (qd, kd, vd))
    for backend in ("flash", "math"):
        fn = lambda a, c, d, b=backend: attention(a, c, d, causal=False, q_doc=q_doc, k_doc=k_doc, backend=b)[0]  # noqa: E731
        errors = _errors(*_run(fn, q, k, v, dout), ref.detach(), ref_grads)
        assert max(errors) <= TOL, (backend, q_doc.tolist(), k_doc.tolist(), errors)


@pytest.mark.parametrize("heads,kv_heads,head", [(6, 2, 4), (8, 4, 3), (6, 3, 2), (6, 2, 3), (12, 4, 8)])
def test_grouped_heads_that_cannot_split_are_refused(heads, kv_heads, head):
    with pytest.raises(ConfigError):
        check_heads(heads, kv_heads, head)


def test_query_heads_not_a_multiple_of_kv_heads_are_refused():
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, k.clone())
    with pytest.raises(ConfigError):
        check_heads(6, 4, 1)
