"""Local (single-device) attention that returns the output AND its log-sum-exp, with a backward.

Layout: q [batch, seq_q, heads, head_dim], k/v [batch, seq_k, kv_heads, head_dim] (grouped-query
attention when kv_heads < heads). Returns out [batch, seq_q, heads, head_dim] and lse
[batch, heads, seq_q] in fp32, the natural log of each query row's softmax denominator. fp32 is the
floor of every statistic here (lse, merges, gradient accumulators, the math backend): fp64 inputs keep
fp64 (`stat_dtype`), as the norm and the loss do, so an fp64 run is a true fp64 reference.

Why the lse: ring attention splits one attention into blocks over key/value shards and merges the
partial outputs with their lse, and its backward recomputes each block's softmax from the global
lse. So the kernels here are exposed as a pair `attention_forward` / `attention_backward`, and
`attention` is the autograd-aware wrapper the single-device model uses.

Masks: `causal` is the lower-triangular mask of a square block (query i sees keys 0..i);
`q_doc` / `k_doc` are document ids per position ([batch, seq]); a query attends only to keys of
the same document. A query row that sees no key at all returns 0 with lse = -inf.

Backends, named after what they call: "flash" calls fused flash-attention kernels that return the
lse: `_scaled_dot_product_flash_attention_for_cpu` on CPU; on CUDA with bf16/fp16 and documents,
one variable-length flash call per round of segment pairs (ops/varlen.py: flash-attn when
installed, else PyTorch's own varlen flash op; plain causal attention is one pair per row), in
fp32 PyTorch's memory-efficient kernel; "math"
is a plain-PyTorch reference in fp32 (matmul, softmax), used for testing and as the fallback.

Documents: with document ids (or a SegmentPlan from ops/segments.py) attention runs only over
same-document segment pairs, pairs of one shape batched into one kernel call; no [S_q, S_k]
mask or bias exists on any path, forward or backward.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import varlen
from .segments import SegmentPlan, cached_plan, whole_rows_plan

NEG_INF = float("-inf")


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of x's attention statistics: fp32 for bf16 / fp16 / fp32, fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _to_bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, kv, d] -> [b, s, heads, d] by repeating each kv head for its query group."""
    kv = x.shape[2]
    if kv == heads:
        return x
    return x.repeat_interleave(heads // kv, dim=2)


def _reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of _expand_kv for gradients: sum over each group of query heads."""
    b, s, h, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _check_square(seq_q: int, seq_k: int) -> None:
    if seq_q != seq_k:
        raise ValueError(f"causal attention needs as many queries as keys here, got {seq_q} and {seq_k}")


def causal_mask(seq_q: int, seq_k: int, device) -> torch.Tensor:
    """Boolean lower-triangular mask [1, 1, seq_q, seq_k] of the math reference (never used with documents)."""
    _check_square(seq_q, seq_k)
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()[None, None]


def _check(q, k, v, q_doc, k_doc):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects [batch, seq, heads, head_dim] tensors, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    for name, doc, x in (("q_doc", q_doc, q), ("k_doc", k_doc, k)):
        if doc is not None and tuple(doc.shape) != tuple(x.shape[:2]):
            raise ValueError(f"{name} must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(doc.shape)}")


# ----------------------------------------------------------------------------------------------
# math backend: the reference


def _math_forward(q, k, v, mask, scale):
    h, acc = q.shape[2], stat_dtype(q)
    qf, kf, vf = (_to_bhsd(t).to(acc) for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    out = torch.matmul(p, vf)
    return _to_bhsd(out).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, mask, scale, dlse=None):
    """Flash-style backward from the saved (global) lse: P = exp(S - lse), dS = P * (dP - D + dlse)."""
    h, kvh, acc = q.shape[2], k.shape[2], stat_dtype(q)
    qf, kf, vf = (_to_bhsd(t).to(acc) for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
    do, of = _to_bhsd(dout).to(acc), _to_bhsd(out).to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(acc)[..., None]
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dq, dk, dv = (_to_bhsd(t) for t in (dq, dk, dv))
    return dq.to(q.dtype), _reduce_kv(dk, kvh).to(k.dtype), _reduce_kv(dv, kvh).to(v.dtype)


# ----------------------------------------------------------------------------------------------
# flash backend: PyTorch's fused flash-attention kernels (CUDA: its memory-efficient kernel for now)


def _flash_forward(q, k, v, causal, scale):
    h = q.shape[2]
    sq = q.shape[1]
    qt, kt, vt = (_to_bhsd(t) for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, None, True, 0.0, causal, scale=scale)
        lse = lse[..., :sq]  # the kernel pads lse rows to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=scale)
    return _to_bhsd(out), lse.to(stat_dtype(q))


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    h, kvh = q.shape[2], k.shape[2]
    qt, kt, vt, ot, dot = (_to_bhsd(t) for t in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout.contiguous()))
    if q.device.type == "cuda":
        dq, dk, dv = _cuda_efficient_backward(dot, qt, kt, vt, None, ot, lse, causal, scale)
    else:
        # Rows that see no key have lse = -inf; the kernel wants a finite value there (their grads are 0), in
        # fp32, or fp64 for fp64 inputs (it refused a float64 model's backward: "expected Double")
        lse_k = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(stat_dtype(q))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dot, qt, kt, vt, ot, lse_k, 0.0, causal, scale=scale)
    dq, dk, dv = (_to_bhsd(t) for t in (dq, dk, dv))
    return dq, _reduce_kv(dk, kvh), _reduce_kv(dv, kvh)


def _cuda_efficient_backward(dot, qt, kt, vt, bias, ot, lse, is_causal, scale):
    # The kernel stores lse rows padded to a multiple of 32; give it back in that shape.
    sq = qt.shape[2]
    padded = (sq + 31) // 32 * 32
    lse = torch.nn.functional.pad(lse.float(), (0, padded - sq)).contiguous()
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    seed = torch.zeros((), dtype=torch.int64, device=qt.device)
    offset = torch.zeros((), dtype=torch.int64, device=qt.device)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dot, qt, kt, vt, bias, ot, lse, seed, offset, 0.0,
        (True, True, True, False), is_causal, scale=scale)  # never the bias gradient: a dense [b, h, sq, sk]
    return grads[0], grads[1], grads[2]


# ----------------------------------------------------------------------------------------------
# Dense blocks (no documents) and document-sparse execution over a SegmentPlan


def _dense_forward(q, k, v, causal, scale, backend):
    if backend == "math":
        return _math_forward(q, k, v, causal_mask(q.shape[1], k.shape[1], q.device) if causal else None, scale)
    return _flash_forward(q, k, v, causal, scale)


def _dense_backward(dout, q, k, v, out, lse, causal, scale, backend, dlse=None):
    if dlse is not None:
        return _math_backward_rows(dout, q, k, v, out, lse, causal, scale, dlse)
    if backend == "math":
        mask = causal_mask(q.shape[1], k.shape[1], q.device) if causal else None
        return _math_backward(dout, q, k, v, out, lse, mask, scale)
    return _flash_backward(dout, q, k, v, out, lse, causal, scale)


_LSE_GRAD_ROWS = 1024  # query rows per block of the math backward that carries an lse gradient


def _math_backward_rows(dout, q, k, v, out, lse, causal, scale, dlse):
    """_math_backward by blocks of query rows. The flash kernels take no lse gradient, so this backward
    runs on any backend, and in one piece it held [b, h, S_q, S_k] fp32 scores, probabilities and their
    gradients plus an S x S mask (2 GiB each at 16K tokens and 2 heads); a block holds [b, h, rows, S_k]
    and, causal, only the keys up to its last query. Accumulated in fp32 (fp64 for fp64 inputs)."""
    if causal:
        _check_square(q.shape[1], k.shape[1])
    qf, kf, vf = (t.to(stat_dtype(q)) for t in (q, k, v))
    dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for s in range(0, q.shape[1], _LSE_GRAD_ROWS):
        e = min(s + _LSE_GRAD_ROWS, q.shape[1])
        keys = e if causal else k.shape[1]
        mask = torch.ones(e - s, keys, dtype=torch.bool, device=q.device).tril(s)[None, None] if causal else None
        gq, gk, gv = _math_backward(dout[:, s:e], qf[:, s:e], kf[:, :keys], vf[:, :keys], out[:, s:e],
                                    lse[..., s:e], mask, scale, dlse[..., s:e])
        dq[:, s:e] = gq
        dk[:, :keys] += gk
        dv[:, :keys] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Rows:
    """The token rows of one pair group in a flat [tokens, ...] tensor: a strided view when the
    segments are evenly spaced and do not overlap (no copy), else an index."""

    def __init__(self, starts: np.ndarray, length: int, device):
        self.n, self.length, self.start = len(starts), length, int(starts[0])
        steps = np.diff(starts)
        self.step = int(steps[0]) if self.n > 1 else length
        self.strided = self.n == 1 or (bool(np.all(steps == self.step)) and self.step >= length)
        self.index = None if self.strided else torch.from_numpy(
            (starts[:, None] + np.arange(length)).reshape(-1)).to(device, non_blocking=True)

    def tiles(self, total: int) -> bool:
        """True when the segments are the whole flat tensor back to back (start 0, no gaps)."""
        return self.strided and self.start == 0 and self.step == self.length and self.n * self.length == total

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        row = flat.stride(0)
        return flat.as_strided((self.n, self.length, *flat.shape[1:]), (self.step * row, row, *flat.stride()[1:]),
                               flat.storage_offset() + self.start * row)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """[n, length, ...] rows of `flat` [tokens, ...]."""
        if self.strided:
            return self._view(flat)
        return flat.index_select(0, self.index).view(self.n, self.length, *flat.shape[1:])

    def put(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        if self.strided:
            self._view(flat).copy_(values)
        else:
            flat.index_copy_(0, self.index, values.reshape(-1, *flat.shape[1:]))

    def add(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """flat[rows] += values, duplicates summed."""
        if self.strided:
            self._view(flat).add_(values)
        else:
            flat.index_add_(0, self.index, values.reshape(-1, *flat.shape[1:]).to(flat.dtype))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _whole_tiling(plan: SegmentPlan, q_rows: int, k_rows: int, device):
    """(query rows, key rows, group) when the plan is one group whose pairs tile queries and keys
    exactly (e.g. equal documents packed back to back), else None."""
    if plan.multi or len(plan.groups) != 1:
        return None
    g = plan.groups[0]
    qr, kr = _Rows(g.q_start, g.q_len, device), _Rows(g.k_start, g.k_len, device)
    return (qr, kr, g) if qr.tiles(q_rows) and kr.tiles(k_rows) else None


def _sparse_forward(q, k, v, plan: SegmentPlan, scale, backend):
    """Attention of every visible segment pair, pairs of one shape per kernel call; rows that see no
    key come back as out = 0, lse = -inf. Results of a row covered by several pairs are merged in fp32."""
    b, sq, h, d = q.shape
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    whole = _whole_tiling(plan, qf.shape[0], kf.shape[0], q.device)
    if whole is not None:  # one group of equal documents back to back: the kernel's result is the answer
        qr, kr, g = whole
        o, l_ = _dense_forward(qr.gather(qf), kr.gather(kf), kr.gather(vf), g.causal, scale, backend)
        return o.reshape(q.shape), l_.transpose(1, 2).reshape(b, sq, h).transpose(1, 2).contiguous()
    acc = stat_dtype(q)
    out = torch.zeros((b * sq, h, d), dtype=acc if plan.multi else q.dtype, device=q.device)
    lse = torch.full((b * sq, h), NEG_INF, dtype=acc, device=q.device)  # token-major while filling
    for g in plan.groups:
        qr, kr = _Rows(g.q_start, g.q_len, q.device), _Rows(g.k_start, g.k_len, q.device)
        o, l_ = _dense_forward(qr.gather(qf), kr.gather(kf), kr.gather(vf), g.causal, scale, backend)
        l_ = l_.transpose(1, 2)  # [n, q_len, h]
        if not plan.multi:
            qr.put(out, o)
            qr.put(lse, l_)
            continue
        old = qr.gather(lse)
        new = torch.logaddexp(old, l_)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        merged = qr.gather(out) * torch.exp(old - safe)[..., None] + o.to(acc) * torch.exp(l_ - safe)[..., None]
        qr.put(out, merged)
        qr.put(lse, new)
    return out.to(q.dtype).view(b, sq, h, d), lse.view(b, sq, h).transpose(1, 2).contiguous()


def _sparse_backward(dout, q, k, v, out, lse, plan: SegmentPlan, scale, backend, dlse=None):
    """Gradients of _sparse_forward from the (global) out and lse; accumulated in fp32."""
    qf, kf, vf, of, dof = _flat(q), _flat(k), _flat(v), _flat(out), _flat(dout)
    lse_t = _flat(lse.transpose(1, 2))  # [tokens, h]
    dlse_t = None if dlse is None else _flat(dlse.transpose(1, 2))
    whole = _whole_tiling(plan, qf.shape[0], kf.shape[0], q.device)
    if whole is not None:  # no accumulators: the kernel's gradients are the whole gradients
        qr, kr, g = whole
        gl = None if dlse_t is None else qr.gather(dlse_t).transpose(1, 2)
        gq, gk, gv = _dense_backward(qr.gather(dof), qr.gather(qf), kr.gather(kf), kr.gather(vf), qr.gather(of),
                                     qr.gather(lse_t).transpose(1, 2), g.causal, scale, backend, gl)
        return gq.reshape(q.shape), gk.reshape(k.shape), gv.reshape(v.shape)
    acc = stat_dtype(q)
    dq = torch.zeros(qf.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kf.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vf.shape, dtype=acc, device=q.device)
    for g in plan.groups:
        qr, kr = _Rows(g.q_start, g.q_len, q.device), _Rows(g.k_start, g.k_len, q.device)
        gl = None if dlse_t is None else qr.gather(dlse_t).transpose(1, 2)
        gq, gk, gv = _dense_backward(qr.gather(dof), qr.gather(qf), kr.gather(kf), kr.gather(vf), qr.gather(of),
                                     qr.gather(lse_t).transpose(1, 2), g.causal, scale, backend, gl)
        qr.add(dq, gq.to(acc))
        kr.add(dk, gk.to(acc))
        kr.add(dv, gv.to(acc))
    return dq.to(q.dtype).view(q.shape), dk.to(k.dtype).view(k.shape), dv.to(v.dtype).view(v.shape)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys of the same queries, merged by their log-sum-exp:
    out [b, s, h, d] (any dtype), lse [b, h, s] fp32 -> (out fp32, lse); fp64 stays fp64. Each weight is
    exp(lse_part - lse_total) <= 1 (no overflow); rows that saw no key (lse -inf) stay 0 without NaNs."""
    new = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_a = torch.exp(lse_a - safe).transpose(1, 2)[..., None]  # [b, s, h, 1]
    w_b = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    acc = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), new.dtype)
    return out_a.to(acc) * w_a + out_b.to(acc) * w_b, new


# ----------------------------------------------------------------------------------------------
# Public API

BACKENDS = ("flash", "math")


def _resolve(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend '{backend}'; choose one of {BACKENDS}")
    if backend == "flash" and q.device.type not in ("cpu", "cuda"):
        return "math"
    return backend


def _plan(q, k, causal, q_doc, k_doc, plan):
    if plan is not None:
        return plan
    if q_doc is None and k_doc is None:
        if causal and q.shape[1] != k.shape[1]:
            raise ValueError(f"causal attention needs as many queries as keys here, got {q.shape[1]} and {k.shape[1]}")
        return None
    if q_doc is None or k_doc is None:
        raise ValueError("document masks need both q_doc and k_doc")
    return cached_plan(q_doc, k_doc, causal)


def attention_forward(q, k, v, *, causal=True, q_doc=None, k_doc=None, scale=None, backend="flash", plan=None):
    """Forward only: (out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32). No autograd graph.

    With document ids (or a precomputed `plan`, ops/segments.py) only same-document segment pairs
    are computed; no [sq, sk] tensor is built."""
    _check(q, k, v, q_doc, k_doc)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = _resolve(backend, q)
    plan = _plan(q, k, causal, q_doc, k_doc, plan)
    if plan is None and backend == "flash" and varlen.available(q):  # plain causal: the flash kernel too
        plan = whole_rows_plan(q.shape[0], q.shape[1], k.shape[1], causal)
    with torch.no_grad():
        if plan is None:
            return _dense_forward(q, k, v, causal, scale, backend)
        if backend == "flash" and varlen.available(q):  # CUDA, bf16/fp16: one varlen kernel call per round
            return varlen.varlen_forward(q, k, v, plan, scale)
        return _sparse_forward(q, k, v, plan, scale, backend)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, q_doc=None, k_doc=None, scale=None,
                       backend="flash", dlse=None, plan=None):
    """Gradients (dq, dk, dv) of one attention from its output and the lse to normalise with.

    `out` and `lse` may be the *global* output and lse of a larger attention this call is one block
    of (ring attention); then the result is this block's share of the global gradients.
    `dlse`, the gradient flowing into the lse, if any, is handled by the math backward (by blocks of
    query rows: no [S_q, S_k] tensor either).
    """
    _check(q, k, v, q_doc, k_doc)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = _resolve(backend, q)
    plan = _plan(q, k, causal, q_doc, k_doc, plan)
    if plan is None and backend == "flash" and dlse is None and varlen.available(q):
        plan = whole_rows_plan(q.shape[0], q.shape[1], k.shape[1], causal)
    with torch.no_grad():
        if plan is None:
            return _dense_backward(dout, q, k, v, out, lse, causal, scale, backend, dlse)
        if backend == "flash" and dlse is None and varlen.available(q):
            return varlen.varlen_backward(dout, q, k, v, out, lse, plan, scale)
        return _sparse_backward(dout, q, k, v, out, lse, plan, scale, backend, dlse)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_doc, k_doc, causal, scale, backend):
        out, lse = attention_forward(q, k, v, causal=causal, q_doc=q_doc, k_doc=k_doc, scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        # an unused lse then arrives as None, not as zeros that the host would have to inspect
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_doc, k_doc = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, q_doc=q_doc, k_doc=k_doc,
                                        scale=ctx.scale, backend=ctx.backend, dlse=dlse)
        return dq, dk, dv, None, None, None, None, None


def attention(q, k, v, *, causal=True, q_doc=None, k_doc=None, scale=None, backend="flash"):
    """Differentiable attention returning (out, lse); gradients flow through both."""
    _check(q, k, v, q_doc, k_doc)
    return _Attention.apply(q, k, v, q_doc, k_doc, causal, scale, backend)
