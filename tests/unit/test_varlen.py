"""ops/varlen.py: varlen flash glue, on CPU against fakes of the kernels written from their contracts.

The real kernels are CUDA-only. `fake_flash_attn_varlen_forward/backward` below implement the
documented contract of a variable-length flash-attention call in plain float64 PyTorch:
q [total_q, h, d], k/v [total_k, kv, d] (query head i reads kv head i // (h // kv)), int32
cu_seqlens [n + 1] from 0, one softmax(q_i k_i^T * scale) v_i per sequence, causal masks aligned
to the bottom-right corner, out [total_q, h, d] in the input dtype, lse [h, total_q] fp32; the
backward takes out and lse as given (it does not recompute them) and applies the flash formulas
P = exp(S * scale - lse), dS = P * (dP - rowsum(dout * out)).
The module's `_kernel_forward/_kernel_backward` are replaced by them, and varlen_forward/backward
are compared with a dense float64 reference.
"""

import math
import sys
import types

import numpy as np
import pytest
import torch

from longctx.ops import varlen
from longctx.ops.segments import plan_pairs
from longctx.ops.varlen import available, varlen_backward, varlen_forward, varlen_rounds

# ----------------------------------------------------------------------------------------------
# The kernel contract, as a reference


def _check_cu(cu, total, max_len, name):
    assert cu.dtype == torch.int32, f"{name} must be int32, got {cu.dtype}"
    assert cu.dim() == 1 and cu.numel() >= 2
    c = cu.tolist()
    assert c[0] == 0 and c[-1] == total, f"{name} must run from 0 to {total}, got {c[0]}..{c[-1]}"
    lengths = np.diff(c)
    assert np.all(lengths >= 0), f"{name} must be non-decreasing"
    assert max_len >= lengths.max(), f"max_seqlen {max_len} below the longest sequence {lengths.max()}"
    return c


def _causal_mask(lq, lk):
    """Bottom-right aligned causal mask (flash-attn >= 2.1): query i sees keys j <= i + lk - lq."""
    return torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)


def _sequences(q, k, cu_q, cu_k, max_q, max_k):
    assert q.dim() == 3 and k.dim() == 3 and q.shape[2] == k.shape[2]
    assert q.shape[1] % k.shape[1] == 0, "heads must be a multiple of kv heads"
    cq = _check_cu(cu_q, q.shape[0], max_q, "cu_seqlens_q")
    ck = _check_cu(cu_k, k.shape[0], max_k, "cu_seqlens_k")
    assert len(cq) == len(ck)
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def _scores(qi, ki, scale, causal, g):
    s = torch.einsum("qhd,khd->hqk", qi.double(), ki.double().repeat_interleave(g, 1)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(qi.shape[0], ki.shape[0]), float("-inf"))
    return s


def fake_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    total_q, h, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(total_q, h, d, dtype=torch.float64)
    lse = torch.full((h, total_q), float("inf"), dtype=torch.float64)  # the kernel's value for empty rows
    for q0, q1, k0, k1 in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        s = _scores(q[q0:q1], k[k0:k1], scale, causal, g)
        l_ = torch.logsumexp(s, -1)  # [h, lq]
        seen = torch.isfinite(l_)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, l_, 0)[..., None]), 0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].double().repeat_interleave(g, 1))
        lse[:, q0:q1] = torch.where(seen, l_, float("inf"))
    return out.to(q.dtype), lse.float()


def fake_flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, scale):
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[1], q.shape[0]), "lse must be [h, total_q] fp32"
    assert dout.shape == q.shape == out.shape
    total_q, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    dq = torch.zeros(total_q, h, d, dtype=torch.float64)
    dk = torch.zeros(k.shape[0], h, d, dtype=torch.float64)
    dv = torch.zeros(k.shape[0], h, d, dtype=torch.float64)
    for q0, q1, k0, k1 in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        s = _scores(q[q0:q1], k[k0:k1], scale, causal, g)
        p = torch.exp(s - lse[:, q0:q1].double()[..., None])  # from the GIVEN lse; masked entries are exp(-inf) = 0
        do, o = dout[q0:q1].double(), out[q0:q1].double()
        ke, ve = k[k0:k1].double().repeat_interleave(g, 1), v[k0:k1].double().repeat_interleave(g, 1)
        dv[k0:k1] += torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, ve)
        delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # rowsum(dout * out): [h, lq, 1]
        ds = p * (dp - delta)
        dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, ke) * scale
        dk[k0:k1] += torch.einsum("hqk,qhd->khd", ds, q[q0:q1].double()) * scale
    dk = dk.view(-1, kvh, g, d).sum(2)
    dv = dv.view(-1, kvh, g, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    calls = []

    def fwd(*args):
        calls.append(("fwd", args[5], args[6], args[7]))
        return fake_flash_attn_varlen_forward(*args)

    def bwd(*args):
        calls.append(("bwd", args[8], args[9], args[10]))
        return fake_flash_attn_varlen_backward(*args)

    monkeypatch.setattr(varlen, "_kernel_forward", fwd)
    monkeypatch.setattr(varlen, "_kernel_backward", bwd)
    return calls


# ----------------------------------------------------------------------------------------------
# Dense reference and inputs


def reference(q, k, v, causal, q_doc, k_doc, q_pos=None, k_pos=None, scale=None):
    """Textbook attention in float64 with autograd; a query sees keys of its document (and, causal,
    keys at positions <= its own; same-index order without positions)."""
    _, sq, h, d = q.shape
    g = h // k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 2), vd.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    allowed = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
    if causal:
        if q_pos is None:
            allowed = allowed & torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).tril()
        else:
            q_pos, k_pos = (torch.as_tensor(p, device=q.device) for p in (q_pos, k_pos))
            allowed = allowed & (k_pos[:, None, None, :] <= q_pos[:, None, :, None])
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    empty = ~allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1) * allowed
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    return out, lse


def doc_row(rng, s, max_len, pad=0, min_len=1):
    """Document ids of one packed row: random lengths in [min_len, max_len], then `pad` padding tokens as
    one more document."""
    lengths = []
    while sum(lengths) < s - pad:
        lengths.append(int(rng.integers(min_len, max_len + 1)))
    lengths[-1] -= sum(lengths) - (s - pad)
    lengths = [n for n in lengths if n > 0] + ([pad] if pad else [])
    return np.repeat(np.arange(len(lengths)), lengths)


def tensors(b, sq, sk, h, kv, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, dtype=dtype)
    k = torch.randn(b, sk, kv, d, generator=gen, dtype=dtype)
    v = torch.randn(b, sk, kv, d, generator=gen, dtype=dtype)
    return q, k, v


def check(q, k, v, plan, causal, q_doc, k_doc, q_pos=None, k_pos=None, atol=2e-5):
    """varlen_forward/backward (through the fakes) against the dense reference."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = varlen_forward(q, k, v, plan, scale)
    ql, kl, vl = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(ql, kl, vl, causal, torch.as_tensor(q_doc), torch.as_tensor(k_doc), q_pos, k_pos)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=atol, rtol=atol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # rows that see no key: -inf
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=atol, rtol=atol)

    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    dq, dk, dv = varlen_backward(gout, q, k, v, out, lse, plan, scale)
    ref = torch.autograd.grad((ref_out * gout.double()).sum(), (ql, kl, vl))
    for got, want, name in zip((dq, dk, dv), ref, "qkv"):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=atol * 5, rtol=atol * 5, msg=f"d{name}")
    return out, lse


def ring_block(rng, b, chunks, chunk, q_chunks, k_chunks, max_doc, pad=0):
    """Query and key tokens of one ring-attention block: a global packed row of chunks * chunk
    tokens, the queries holding chunks `q_chunks` and the keys `k_chunks` (the same chunks, or
    disjoint ones). Returns doc ids and global positions [b, len] of both."""
    n = chunks * chunk
    g_doc = np.stack([doc_row(rng, n, max_doc, pad=pad) for _ in range(b)])
    q_pos = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in q_chunks])
    k_pos = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in k_chunks])
    q_pos, k_pos = np.tile(q_pos, (b, 1)), np.tile(k_pos, (b, 1))  # distinct arrays even for equal chunks
    return g_doc[:, q_pos[0]], g_doc[:, k_pos[0]], q_pos, k_pos


# ----------------------------------------------------------------------------------------------
# Round construction


def _round_invariants(plan):
    vp = varlen_rounds(plan)
    seen = []
    for r in vp.rounds:
        q_rows, k_rows = r.q_index.numpy(), r.k_index.numpy()
        assert r.q_index.dtype == torch.int64 and r.k_index.dtype == torch.int64
        assert len(np.unique(q_rows)) == len(q_rows), "a query row twice in one round"
        assert np.all(plan.causal[r.pairs] == r.causal), "one causal flag per round"
        for cu, rows, lens, mx in ((r.cu_seqlens_q, q_rows, plan.q_len[r.pairs], r.max_seqlen_q),
                                   (r.cu_seqlens_k, k_rows, plan.k_len[r.pairs], r.max_seqlen_k)):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and len(cu) == r.num_seqs + 1
            c = cu.numpy().astype(np.int64)
            assert c[0] == 0 and np.all(np.diff(c) > 0) and c[-1] == len(rows)
            assert np.array_equal(np.diff(c), lens)
            assert mx == lens.max()
        if r.causal:
            assert np.array_equal(np.diff(r.cu_seqlens_q.numpy()), np.diff(r.cu_seqlens_k.numpy())), "square"
        cq, ck = r.cu_seqlens_q.numpy(), r.cu_seqlens_k.numpy()
        for i, p in enumerate(r.pairs):
            assert np.array_equal(q_rows[cq[i]:cq[i + 1]], np.arange(plan.q_start[p], plan.q_start[p] + plan.q_len[p]))
            assert np.array_equal(k_rows[ck[i]:ck[i + 1]], np.arange(plan.k_start[p], plan.k_start[p] + plan.k_len[p]))
        assert r.q_identity == np.array_equal(q_rows, np.arange(vp.num_q_rows))
        assert r.k_identity == np.array_equal(k_rows, np.arange(vp.num_k_rows))
        seen.extend(r.pairs.tolist())
    assert sorted(seen) == list(range(plan.num_pairs)), "every pair in exactly one round"
    # as few rounds as the pairs allow: per kind, the most pairs any query segment has
    for kind in (True, False):
        starts = plan.q_start[plan.causal == kind]
        need = np.unique(starts, return_counts=True)[1].max() if len(starts) else 0
        assert sum(r.causal == kind for r in vp.rounds) == need
    return vp


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_rounds_of_packed_rows(causal, seed):
    rng = np.random.default_rng(seed)
    docs = np.stack([doc_row(rng, 64, 9, pad=5 * (seed % 2)) for _ in range(2)])
    plan = plan_pairs(docs, docs, causal=causal)
    vp = _round_invariants(plan)
    # one document per segment attending to itself: one round covering every row and key in order
    assert len(vp.rounds) == 1 and vp.rounds[0].q_identity and vp.rounds[0].k_identity
    assert vp.rounds[0].causal == causal


@pytest.mark.parametrize("q_chunks,k_chunks", [([1, 6], [1, 6]), ([1, 6], [0, 7]), ([6], [0, 2, 4]),
                                               ([2, 5], [3, 4]), ([0, 3], [1, 2])])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_rounds_of_ring_blocks(q_chunks, k_chunks, causal, seed):
    rng = np.random.default_rng(seed)
    qd, kd, qp, kp = ring_block(rng, 2, 8, 4, q_chunks, k_chunks, max_doc=12)
    _round_invariants(plan_pairs(qd, kd, causal=causal, q_pos=qp, k_pos=kp))


def test_rounds_separate_by_kind_and_multiplicity():
    # one document everywhere: the query chunk sees three earlier key chunks, three full pairs -> three rounds
    qd, kd = np.zeros((1, 4), dtype=np.int64), np.zeros((1, 12), dtype=np.int64)
    qp = np.arange(24, 28)[None]
    kp = np.concatenate([np.arange(0, 4), np.arange(8, 12), np.arange(16, 20)])[None]
    plan = plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp)
    assert plan.multi and plan.num_pairs == 3
    vp = _round_invariants(plan)
    assert [r.causal for r in vp.rounds] == [False] * 3
    # two pieces of one document as queries and keys (a zigzag diagonal block): causal round + full round
    pos = np.r_[0:4, 8:12][None]
    plan = plan_pairs(np.zeros((1, 8)), np.zeros((1, 8)), causal=True, q_pos=pos, k_pos=pos.copy())
    assert plan.multi
    vp = _round_invariants(plan)
    assert [(r.causal, r.num_seqs) for r in vp.rounds] == [(True, 2), (False, 1)]
    assert vp.rounds[0].q_identity and not vp.rounds[1].q_identity


def test_rounds_cached_on_plan_and_device():
    docs = np.stack([doc_row(np.random.default_rng(0), 32, 5)])
    plan = plan_pairs(docs, docs, causal=True)
    vp = varlen_rounds(plan)
    assert varlen_rounds(plan) is vp
    on = vp.on(torch.device("cpu"))
    assert vp.on("cpu") is on
    assert torch.equal(on[0].q_index, vp.rounds[0].q_index) and on[0].cu_seqlens_k.dtype == torch.int32


def test_empty_plan():
    qd, kd, qp, kp = ring_block(np.random.default_rng(0), 1, 4, 4, [0], [3], max_doc=20)
    plan = plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp)  # every key after every query
    assert plan.empty and varlen_rounds(plan).rounds == []


# ----------------------------------------------------------------------------------------------
# Execution against the dense reference (kernels replaced by the contract fakes)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("pad", [0, 7])
@pytest.mark.parametrize("seed", range(2))
def test_packed_rows_match_reference(fake_kernels, causal, kv, pad, seed):
    rng = np.random.default_rng(seed)
    docs = np.stack([doc_row(rng, 48, 10, pad=pad) for _ in range(2)])
    docs[0, :3] = [0, 1, 2]  # 1-token documents (ids stay increasing: doc_row starts at 0)
    docs[0, 3:] += 2
    plan = plan_pairs(docs, docs, causal=causal)
    q, k, v = tensors(2, 48, 48, 8, kv, seed=seed)
    check(q, k, v, plan, causal, docs, docs)
    assert len([c for c in fake_kernels if c[0] == "fwd"]) == 1  # the whole block in one call


def test_one_token_documents_and_padding(fake_kernels):
    docs = np.array([[0, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 6, 6, 7, 7, 7],
                     [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 5, 6, 7, 7, 7, 7]])  # row 1 ends in padding (doc 7)
    for causal in (True, False):
        plan = plan_pairs(docs, docs, causal=causal)
        for kv in (8, 2, 1):
            q, k, v = tensors(2, 16, 16, 8, kv, seed=kv)
            check(q, k, v, plan, causal, docs, docs)


@pytest.mark.parametrize("causal", [True, False])
def test_thousand_tiny_documents(fake_kernels, causal):
    rng = np.random.default_rng(3)
    docs = doc_row(rng, 1600, 2, pad=9)[None]
    assert docs.max() + 1 > 1000
    plan = plan_pairs(docs, docs, causal=causal)
    q, k, v = tensors(1, 1600, 1600, 2, 1, seed=1)
    check(q, k, v, plan, causal, docs, docs)


@pytest.mark.parametrize("q_chunks,k_chunks", [([1, 6], [1, 6]), ([1, 6], [0, 7]), ([6], [0, 2, 4]),
                                               ([2, 5], [3, 4]), ([0], [3])])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv", [8, 2, 1])
def test_ring_blocks_match_reference(fake_kernels, q_chunks, k_chunks, causal, kv):
    rng = np.random.default_rng(len(q_chunks) * 10 + kv)
    qd, kd, qp, kp = ring_block(rng, 2, 8, 4, q_chunks, k_chunks, max_doc=14, pad=3)
    plan = plan_pairs(qd, kd, causal=causal, q_pos=qp, k_pos=kp)
    q, k, v = tensors(2, qd.shape[1], kd.shape[1], 8, kv, seed=kv)
    check(q, k, v, plan, causal, qd, kd, qp, kp)


def test_multi_plan_two_pieces_of_one_document(fake_kernels):
    """Queries and keys: positions 0-3 and 8-11 of document 0 (and other documents in row 1)."""
    pos = np.tile(np.r_[0:4, 8:12], (2, 1))
    docs = np.array([[0] * 8, [0, 0, 1, 1, 1, 1, 1, 2]])
    plan = plan_pairs(docs, docs, causal=True, q_pos=pos, k_pos=pos.copy())
    assert plan.multi
    for kv in (8, 2, 1):
        q, k, v = tensors(2, 8, 8, 8, kv, seed=kv)
        check(q, k, v, plan, True, docs, docs, pos, pos)
    assert {c[3] for c in fake_kernels} == {True, False}  # a causal and a full round


def test_several_full_rounds_merge(fake_kernels):
    qd, kd = np.zeros((2, 4), dtype=np.int64), np.zeros((2, 12), dtype=np.int64)
    kd[1, :4] = -1  # row 1: the first key chunk is another document
    qp = np.tile(np.arange(24, 28), (2, 1))
    kp = np.tile(np.r_[0:4, 8:12, 16:20], (2, 1))
    plan = plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp)
    assert len(varlen_rounds(plan).rounds) == 3
    q, k, v = tensors(2, 4, 12, 8, 2)
    check(q, k, v, plan, True, qd, kd, qp, kp)


def test_rows_without_keys(fake_kernels):
    qd, kd, qp, kp = ring_block(np.random.default_rng(0), 2, 4, 4, [0, 3], [2], max_doc=6)
    plan = plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp)
    q, k, v = tensors(2, 8, 4, 4, 2)
    out, lse = check(q, k, v, plan, True, qd, kd, qp, kp)
    assert torch.isinf(lse[:, :, :4]).all() and (out[:, :4] == 0).all()  # chunk 0 precedes every key


def test_empty_plan_execution(fake_kernels):
    qd, kd, qp, kp = ring_block(np.random.default_rng(0), 1, 4, 4, [0], [3], max_doc=20)
    plan = plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp)
    q, k, v = tensors(1, 4, 4, 4, 2)
    out, lse = check(q, k, v, plan, True, qd, kd, qp, kp)
    assert not fake_kernels and (out == 0).all() and torch.isinf(lse).all()


def test_backward_uses_global_out_and_lse(fake_kernels):
    """Ring attention: queries (zigzag chunks 0 and 3 of 4) against all keys in two blocks; each
    block's backward with the GLOBAL out/lse gives its share of the full gradients."""
    rng = np.random.default_rng(5)
    b, chunk, h, kvh = 2, 6, 4, 2
    g_doc = np.stack([doc_row(rng, 4 * chunk, 9) for _ in range(b)])
    pos = {c: np.arange(c * chunk, (c + 1) * chunk) for c in range(4)}
    q_pos = np.r_[pos[0], pos[3]]
    blocks = [np.r_[pos[0], pos[3]], np.r_[pos[1], pos[2]]]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 2 * chunk, h, 8, generator=gen)
    k_all = torch.randn(b, 4 * chunk, kvh, 8, generator=gen)
    v_all = torch.randn(b, 4 * chunk, kvh, 8, generator=gen)
    scale = 1 / math.sqrt(8)

    plans, parts = [], []
    for kpos in blocks:
        qp, kp = np.tile(q_pos, (b, 1)), np.tile(kpos, (b, 1))
        plans.append(plan_pairs(g_doc[:, q_pos], g_doc[:, kpos], causal=True, q_pos=qp, k_pos=kp))
        parts.append(varlen_forward(q, k_all[:, kpos], v_all[:, kpos], plans[-1], scale))
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.double() * torch.exp(l_ - lse).transpose(1, 2)[..., None] for o, l_ in parts).float()

    ql, kl, vl = (t.double().requires_grad_() for t in (q, k_all, v_all))
    ref_out, ref_lse = reference(ql, kl, vl, True, torch.as_tensor(g_doc[:, q_pos]), torch.as_tensor(g_doc),
                                 np.tile(q_pos, (b, 1)), np.tile(np.arange(4 * chunk), (b, 1)))
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=2e-5)

    gout = torch.randn(out.shape, generator=gen)
    rq, rk, rv = torch.autograd.grad((ref_out * gout.double()).sum(), (ql, kl, vl))
    dq = torch.zeros_like(rq)
    for plan, kpos in zip(plans, blocks):
        gq, gk, gv = varlen_backward(gout, q, k_all[:, kpos], v_all[:, kpos], out, lse, plan, scale)
        dq += gq.double()
        torch.testing.assert_close(gk.double(), rk[:, kpos], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(gv.double(), rv[:, kpos], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dq, rq, atol=1e-4, rtol=1e-4)


def test_dlse_is_refused(fake_kernels):
    docs = np.zeros((1, 4), dtype=np.int64)
    plan = plan_pairs(docs, docs, causal=True)
    q, k, v = tensors(1, 4, 4, 2, 1)
    out, lse = varlen_forward(q, k, v, plan, 0.5)
    with pytest.raises(NotImplementedError):
        varlen_backward(out, q, k, v, out, lse, plan, 0.5, dlse=torch.ones_like(lse))


def test_plan_must_fit():
    docs = np.zeros((1, 4), dtype=np.int64)
    plan = plan_pairs(docs, docs, causal=True)
    q, k, v = tensors(1, 5, 5, 2, 1)
    with pytest.raises(ValueError, match="does not fit"):
        varlen_forward(q, k, v, plan, 0.5)


# ----------------------------------------------------------------------------------------------
# The kernel glue: the real call sites, against fakes with the real signatures


def _aten_namespace(record):
    """Fakes of torch.ops.aten._flash_attention_forward/_backward with the argument names and order
    of their schemas (checked against the real schemas in test_aten_fake_matches_schema)."""

    def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
        assert dropout_p == 0.0 and return_debug_mask is False and scale is not None
        assert isinstance(max_q, int) and isinstance(max_k, int)
        record.append(("fwd", max_q, query.shape[1], key.shape[1]))
        out, lse = fake_flash_attn_varlen_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                                  scale)
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(()), torch.empty(0)

    def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                  dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                                  window_size_right=None):
        assert dropout_p == 0.0 and scale is not None and rng_state.numel() == 2
        record.append(("bwd", max_q))
        return fake_flash_attn_varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                               max_q, max_k, is_causal, scale)

    return types.SimpleNamespace(_flash_attention_forward=_flash_attention_forward,
                                 _flash_attention_backward=_flash_attention_backward)


def test_aten_fake_matches_schema():
    import inspect

    fakes = _aten_namespace([])
    for name in ("_flash_attention_forward", "_flash_attention_backward"):
        schema = getattr(torch.ops.aten, name).default._schema
        want = [(a.name, a.kwarg_only) for a in schema.arguments]
        params = inspect.signature(getattr(fakes, name)).parameters.values()
        got = [(p.name, p.kind == p.KEYWORD_ONLY) for p in params]
        assert got == want, name
        assert len(schema.returns) == (5 if name.endswith("forward") else 3)


def _flash_attn_fakes(record, old_signature=False):
    """Fakes of flash-attn's flash_attn_varlen_func and _flash_attn_varlen_backward (2.6+ signature,
    or the 2.5 one with a `window_size` pair)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0 and return_attn_probs and softmax_scale is not None
        record.append(("fwd", max_seqlen_q, q.shape[1], k.shape[1]))
        out, lse = fake_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal, softmax_scale)
        return out, lse, torch.empty(0)

    def _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             dropout_p, softmax_scale, causal, deterministic, rng_state):
        assert dropout_p == 0.0 and dq is not None and dk is not None and dv is not None
        record.append(("bwd", max_seqlen_q))
        gq, gk, gv = fake_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                                     max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
        return torch.empty(0)

    if old_signature:
        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        alibi_slopes, deterministic, rng_state=None):
            assert tuple(window_size) == (-1, -1) and alibi_slopes is None
            return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, deterministic, rng_state)
    else:
        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                        window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                        rng_state=None):
            assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0) and alibi_slopes is None
            return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, deterministic, rng_state)

    return flash_attn_varlen_func, _flash_attn_varlen_backward


def _install_flash_attn(monkeypatch, version, fwd, bwd):
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface.flash_attn_varlen_func, iface._flash_attn_varlen_backward = fwd, bwd
    pkg.flash_attn_interface = iface
    pkg.flash_attn_varlen_func = fwd
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    varlen._flash_attn_functions.cache_clear()
    varlen._backend.cache_clear()


@pytest.fixture
def clear_backend_cache():
    cached = (varlen._flash_attn_functions, varlen._backend)  # the originals, whatever a test patches
    yield
    for fn in cached:
        fn.cache_clear()


def _glue_cases():
    # a zigzag diagonal block (causal + full rounds, merged) and 1-token documents with GQA (max_seqlen_q == 1)
    pos = np.tile(np.r_[0:4, 8:12], (2, 1))
    docs = np.array([[0] * 8, [0, 0, 1, 1, 1, 1, 1, 2]])
    yield plan_pairs(docs, docs, causal=True, q_pos=pos, k_pos=pos.copy()), docs, pos, True
    ones = np.arange(8)[None].repeat(2, 0)
    yield plan_pairs(ones, ones, causal=True), ones, None, True
    yield plan_pairs(ones, ones, causal=False), ones, None, False


@pytest.mark.parametrize("backend", ["aten", "flash_attn", "flash_attn_2.5_signature"])
def test_kernel_glue_matches_reference(monkeypatch, clear_backend_cache, backend):
    record = []
    if backend == "aten":
        monkeypatch.setattr(varlen, "_aten_ops", lambda: _aten_namespace(record))
        monkeypatch.setattr(varlen, "_backend", lambda: "aten")
    else:
        fwd, bwd = _flash_attn_fakes(record, old_signature=backend.endswith("signature"))
        _install_flash_attn(monkeypatch, "2.7.4", fwd, bwd)
        assert varlen._flash_attn_functions() is not None
        monkeypatch.setattr(varlen, "_backend", lambda: "flash_attn")
    for plan, docs, pos, causal in _glue_cases():
        for kv in (8, 2):
            q, k, v = tensors(2, 8, 8, 8, kv, seed=kv)
            check(q, k, v, plan, causal, docs, docs, pos, pos)
    fwd_calls = [c for c in record if c[0] == "fwd"]
    assert fwd_calls and any(c[1] == 1 for c in fwd_calls if c[2] == c[3])  # MHA keeps max_seqlen_q == 1
    assert all(c[1] >= 2 for c in fwd_calls if c[2] != c[3])  # GQA never sends max_seqlen_q == 1


def test_flash_attn_version_gate(monkeypatch, clear_backend_cache):
    fwd, bwd = _flash_attn_fakes([])
    _install_flash_attn(monkeypatch, "2.5.8", fwd, bwd)  # padded varlen lse: not used
    assert varlen._flash_attn_functions() is None
    _install_flash_attn(monkeypatch, "2.6.3", fwd, bwd)
    assert varlen._flash_attn_functions() is not None

    def strange(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, something_new):
        raise AssertionError

    _install_flash_attn(monkeypatch, "2.9.0", fwd, strange)  # a backward we cannot call: not used
    assert varlen._flash_attn_functions() is None


def test_unavailable_here(monkeypatch, clear_backend_cache):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    varlen._flash_attn_functions.cache_clear()
    varlen._backend.cache_clear()
    assert varlen._flash_attn_functions() is None
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    assert not available(q)  # CPU
    assert not available(q.float())
    if not torch.cuda.is_available():
        assert varlen._backend() in (None, "aten")
        monkeypatch.setattr(varlen, "_backend", lambda: None)
        with pytest.raises(RuntimeError, match="no variable-length"):
            varlen._kernel_forward(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                   torch.tensor([0, 4], dtype=torch.int32), 4, 4, True, 0.1)


def test_wrong_lse_layout_is_caught(monkeypatch):
    def padded(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
               scale=None):
        n = cum_seq_q.numel() - 1
        return torch.zeros_like(query), torch.zeros(n, query.shape[1], max_q), None, None, None

    monkeypatch.setattr(varlen, "_aten_ops", lambda: types.SimpleNamespace(_flash_attention_forward=padded))
    monkeypatch.setattr(varlen, "_backend", lambda: "aten")
    x = torch.zeros(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="expected"):
        varlen._kernel_forward(x, x, x, cu, cu, 4, 4, True, 0.1)


# ----------------------------------------------------------------------------------------------
# The real kernels


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "aten"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_match_reference(monkeypatch, clear_backend_cache, backend, dtype):
    if backend == "flash_attn" and varlen._flash_attn_functions() is None:
        pytest.skip("flash-attn >= 2.6 not installed")
    if backend == "aten" and not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("PyTorch built without flash attention")
    monkeypatch.setattr(varlen, "_backend", lambda: backend)
    rng = np.random.default_rng(0)
    cases = []
    docs = np.stack([doc_row(rng, 256, 40, pad=17), doc_row(rng, 256, 3)])  # long docs + 1-token docs
    for causal in (True, False):
        cases.append((plan_pairs(docs, docs, causal=causal), docs, docs, None, None, causal))
    for q_chunks, k_chunks in (([1, 6], [1, 6]), ([6], [0, 2, 4]), ([1, 6], [0, 7])):
        qd, kd, qp, kp = ring_block(rng, 2, 8, 32, q_chunks, k_chunks, max_doc=90, pad=5)
        cases.append((plan_pairs(qd, kd, causal=True, q_pos=qp, k_pos=kp), qd, kd, qp, kp, True))
    for plan, qd, kd, qp, kp, causal in cases:
        for kv in (8, 2, 1):
            q, k, v = (t.cuda().to(dtype) for t in tensors(2, qd.shape[1], kd.shape[1], 8, kv, d=64, seed=kv))
            assert available(q)
            scale = 1 / 8
            out, lse = varlen_forward(q, k, v, plan, scale)
            ql, kl, vl = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref_out, ref_lse = reference(ql, kl, vl, causal, torch.as_tensor(qd).cuda(), torch.as_tensor(kd).cuda(),
                                         None if qp is None else torch.as_tensor(qp).cuda(),
                                         None if kp is None else torch.as_tensor(kp).cuda())
            torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-2, rtol=2e-2)
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite)
            torch.testing.assert_close(lse.double()[finite], ref_lse.detach()[finite], atol=2e-2, rtol=2e-2)
            gout = torch.randn_like(out)
            grads = varlen_backward(gout, q, k, v, out, lse, plan, scale)
            ref = torch.autograd.grad((ref_out * gout.double()).sum(), (ql, kl, vl))
            for got, want in zip(grads, ref):
                torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("with_docs", [True, False])
def test_attention_dispatches_to_varlen_where_available(fake_kernels, monkeypatch, with_docs):
    """ops.attention.attention routes documents AND plain causal attention through the varlen glue
    when the kernel is available (CUDA bf16/fp16); checked here with the contract fakes on CPU."""
    from longctx.ops.attention import attention

    calls = []
    real = varlen.varlen_forward
    monkeypatch.setattr(varlen, "available", lambda q: True)
    monkeypatch.setattr(varlen, "varlen_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    q, k, v = tensors(2, 48, 48, 8, 2)
    doc = torch.from_numpy(np.stack([doc_row(rng, 48, 12), doc_row(rng, 48, 12)])) if with_docs else None
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = attention(qg, kg, vg, causal=True, q_doc=doc, k_doc=doc)
    grads = torch.autograd.grad(out.sum(), (qg, kg, vg))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    one = torch.zeros(2, 48, dtype=torch.long)  # no documents = one document per row
    ref_out, _ = reference(qr, kr, vr, True, one if doc is None else doc, one if doc is None else doc)
    ref_grads = torch.autograd.grad(ref_out.sum(), (qr, kr, vr))
    assert calls, "the varlen path was not taken"
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=2e-5)
