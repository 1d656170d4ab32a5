"""Local (single-device) attention that returns the output AND its log-sum-exp, with a backward.

Layout: q [batch, seq_q, heads, head_dim], k/v [batch, seq_k, kv_heads, head_dim] (grouped-query
attention when kv_heads < heads). Returns out [batch, seq_q, heads, head_dim] and lse
[batch, heads, seq_q] in fp32, the natural log of each query row's softmax denominator.

Why the lse: ring attention splits one attention into blocks over key/value shards and merges the
partial outputs with their lse, and its backward recomputes each block's softmax from the global
lse. So the kernels here are exposed as a pair `attention_forward` / `attention_backward`, and
`attention` is the autograd-aware wrapper the single-device model uses.

Masks: `causal` is the lower-triangular mask of a square block (query i sees keys 0..i);
`q_doc` / `k_doc` are document ids per position ([batch, seq]); a query attends only to keys of
the same document. A query row that sees no key at all returns 0 with lse = -inf.

Backends, named after what they call: "flash" calls PyTorch's fused attention kernels that return
the lse (`_scaled_dot_product_flash_attention_for_cpu` on CPU; on CUDA, for now, the
memory-efficient kernel, which also takes a bias for document masks); "math" is a plain-PyTorch
reference in fp32 (matmul, softmax), used for testing and as the fallback.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


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


def build_mask(seq_q: int, seq_k: int, causal: bool, q_doc, k_doc, device) -> torch.Tensor | None:
    """Boolean mask [batch or 1, 1, seq_q, seq_k], True where a query may attend; None when unmasked."""
    mask = None
    if causal:
        if seq_q != seq_k:
            raise ValueError(f"causal attention needs as many queries as keys here, got {seq_q} and {seq_k}")
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()[None, None]
    if q_doc is not None or k_doc is not None:
        if q_doc is None or k_doc is None:
            raise ValueError("document masks need both q_doc and k_doc")
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        mask = same if mask is None else (mask & same)
    return mask


def _mask_if_needed(backend, q, k, causal, q_doc, k_doc):
    """The dense boolean mask, only where it is used: the math backend, or document masks (which the
    fused kernels take as a bias). Plain causal attention on the fused kernels needs none."""
    if backend == "math" or q_doc is not None:
        return build_mask(q.shape[1], k.shape[1], causal, q_doc, k_doc, q.device)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries as keys here, got {q.shape[1]} and {k.shape[1]}")
    return None


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
    h = q.shape[2]
    qf, kf, vf = (_to_bhsd(t).float() for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
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
    h, kvh = q.shape[2], k.shape[2]
    qf, kf, vf = (_to_bhsd(t).float() for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
    do, of = _to_bhsd(dout).float(), _to_bhsd(out).float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.float()[..., None]
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dq, dk, dv = (_to_bhsd(t) for t in (dq, dk, dv))
    return dq.to(q.dtype), _reduce_kv(dk, kvh).to(k.dtype), _reduce_kv(dv, kvh).to(v.dtype)


# ----------------------------------------------------------------------------------------------
# flash backend: PyTorch's fused flash-attention kernels (CUDA: its memory-efficient kernel for now)


def _additive(mask, dtype, b, h, sq, sk):
    # Rows of the bias are allocated with a length padded to 16: the CUDA kernels need their stride
    # aligned (F.scaled_dot_product_attention pads the same way; the aten ops called here do not).
    padded = (sk + 15) // 16 * 16
    bias = torch.zeros((*mask.shape[:-1], padded), dtype=dtype, device=mask.device)[..., :sk]
    bias.masked_fill_(~mask, NEG_INF)
    return bias.expand(b, h, sq, sk)


def _flash_forward(q, k, v, causal, mask, scale, has_docs):
    # The kernels apply a plain causal mask themselves; document masks go in as an additive bias
    # (which then carries the causal part too).
    h = q.shape[2]
    b, sq, _, _ = q.shape
    sk = k.shape[1]
    qt, kt, vt = (_to_bhsd(t) for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
    bias = _additive(mask, q.dtype, b, h, sq, sk) if has_docs else None
    is_causal = causal and not has_docs
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True, 0.0, is_causal, scale=scale)
        lse = lse[..., :sq]  # the kernel pads lse rows to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, is_causal, attn_mask=bias, scale=scale)
    lse = lse.float()
    if has_docs:
        # A query row that sees no key (its document is absent from this key block, common in ring
        # attention) must come back as out = 0, lse = -inf; kernels differ in what they return there.
        empty = ~mask.any(-1)  # [b, 1, sq]
        if bool(empty.any()):
            lse = lse.masked_fill(empty, NEG_INF)
            out = out.masked_fill(empty[..., None], 0.0)
    return _to_bhsd(out), lse


def _flash_backward(dout, q, k, v, out, lse, causal, mask, scale, has_docs):
    h, kvh = q.shape[2], k.shape[2]
    b, sq, _, _ = q.shape
    sk = k.shape[1]
    qt, kt, vt, ot, dot = (_to_bhsd(t) for t in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout.contiguous()))
    bias = _additive(mask, q.dtype, b, h, sq, sk) if has_docs else None
    is_causal = causal and not has_docs
    if q.device.type == "cuda":
        dq, dk, dv = _cuda_efficient_backward(dot, qt, kt, vt, bias, ot, lse, is_causal, scale)
    else:
        # Rows that see no key have lse = -inf; the kernel wants a finite value there (their grads are 0).
        lse_k = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(torch.float32)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dot, qt, kt, vt, ot, lse_k, 0.0, is_causal, attn_mask=bias, scale=scale)
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
# Public API

BACKENDS = ("flash", "math")


def _resolve(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend '{backend}'; choose one of {BACKENDS}")
    if backend == "flash" and q.device.type not in ("cpu", "cuda"):
        return "math"
    return backend


def attention_forward(q, k, v, *, causal=True, q_doc=None, k_doc=None, scale=None, backend="flash"):
    """Forward only: (out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32). No autograd graph."""
    _check(q, k, v, q_doc, k_doc)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = _resolve(backend, q)
    mask = _mask_if_needed(backend, q, k, causal, q_doc, k_doc)
    with torch.no_grad():
        if backend == "math":
            return _math_forward(q, k, v, mask, scale)
        return _flash_forward(q, k, v, causal, mask, scale, q_doc is not None)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, q_doc=None, k_doc=None, scale=None,
                       backend="flash", dlse=None):
    """Gradients (dq, dk, dv) of one attention from its output and the lse to normalise with.

    `out` and `lse` may be the *global* output and lse of a larger attention this call is one block
    of (ring attention); then the result is this block's share of the global gradients.
    `dlse`, the gradient flowing into the lse, if any, is handled by the math backend.
    """
    _check(q, k, v, q_doc, k_doc)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = "math" if dlse is not None else _resolve(backend, q)
    mask = _mask_if_needed(backend, q, k, causal, q_doc, k_doc)
    with torch.no_grad():
        if backend == "math":
            return _math_backward(dout, q, k, v, out, lse, mask, scale, dlse)
        return _flash_backward(dout, q, k, v, out, lse, causal, mask, scale, q_doc is not None)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_doc, k_doc, causal, scale, backend):
        out, lse = attention_forward(q, k, v, causal=causal, q_doc=q_doc, k_doc=k_doc, scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_doc, k_doc = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and not torch.any(dlse):
            dlse = None
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, q_doc=q_doc, k_doc=k_doc,
                                        scale=ctx.scale, backend=ctx.backend, dlse=dlse)
        return dq, dk, dv, None, None, None, None, None


def attention(q, k, v, *, causal=True, q_doc=None, k_doc=None, scale=None, backend="flash"):
    """Differentiable attention returning (out, lse); gradients flow through both."""
    _check(q, k, v, q_doc, k_doc)
    return _Attention.apply(q, k, v, q_doc, k_doc, causal, scale, backend)
