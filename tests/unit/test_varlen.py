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

Here: those fakes, the dense reference and the inputs (imported by test_varlen_docs.py, which runs
varlen_forward/backward through the fakes on packed documents and ring blocks, and checks the rounds
the plans become), the kernel glue (the real call sites against fakes with the real signatures) and
the real kernels (CUDA).
"""

import math
import sys
import types

import numpy as np
import pytest
import torch

from longctx.ops import varlen
from longctx.ops.segments import plan_pairs
from longctx.ops.varlen import available, varlen_backward, varlen_forward

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
