"""ops/varlen.py on packed documents, on CPU: the rounds a plan of packed rows or ring blocks becomes,
and varlen_forward/backward with the module's `_kernel_forward/_kernel_backward` replaced by the fakes
of the kernels' contract against the dense float64 reference (both written in test_varlen.py, which
states the contract); and ops.attention's dispatch to the varlen glue."""

import math

import numpy as np
import pytest
import torch
from test_varlen import (
    check,
    doc_row,
    fake_flash_attn_varlen_backward,
    fake_flash_attn_varlen_forward,
    reference,
    ring_block,
    tensors,
)

from longctx.ops import varlen
from longctx.ops.segments import plan_pairs
from longctx.ops.varlen import varlen_backward, varlen_forward, varlen_rounds


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
# ops.attention's dispatch to the varlen glue


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
