"""Document-sparse attention on CUDA as variable-length flash-attention calls, one per round of pairs.

ops/segments.py turns document ids into a SegmentPlan: (query segment, key segment) pairs in flat
token offsets, each `causal` (same span, lower triangle) or full. The generic executor
(ops/attention.py, `_sparse_forward`) runs one dense kernel per group of same-shape pairs; here the
whole plan runs as a few *varlen* calls instead: a varlen kernel takes many (query, key) sequences
of different lengths packed along one token axis and described by cumulative offsets
(`cu_seqlens_q`, `cu_seqlens_k`), so every pair becomes one "sequence" of one call.

A call has one `causal` flag and writes each of its query rows once, so the pairs are split into
*rounds* (`varlen_rounds`): all pairs of a round share the causal flag and no query row appears in
two pairs of one round. A causal block usually needs one round (every document attends to itself);
ring blocks need one causal and one full round, and more only where a query segment sees several key
segments of one kind. Rounds covering one row are merged with their log-sum-exp, like the
per-group executor does. Rounds are built once per plan on the host (numpy) and kept on the plan;
their index tensors go to the device once per device, asynchronously (pinned memory,
non_blocking), so the device never waits for the host.

Kernels (exactly one small function per direction touches them, `_kernel_forward` and
`_kernel_backward`):

- flash-attn >= 2.6 when installed: `flash_attn_varlen_func(..., return_attn_probs=True)` forward
  and the explicit `flash_attn_interface._flash_attn_varlen_backward` backward, which takes the
  out and lse to differentiate with. The autograd backward of `flash_attn_varlen_func` would use
  the call's *local* out/lse, wrong for a block of a larger (ring) attention; the explicit op with
  the *global* out/lse is exactly the block's share of the global gradients.
- otherwise PyTorch's own copy of the same kernels, `torch.ops.aten._flash_attention_forward` /
  `_flash_attention_backward` with cum_seq_q / cum_seq_k (what torch.nn.attention.varlen calls).

Contracts relied on (flash-attn docstrings and fake/meta registrations, PyTorch's
_meta_registrations.py, flash_api.cpp of both):
q [total_q, heads, head_dim], k/v [total_k, kv_heads, head_dim] with heads % kv_heads == 0, query
head i reading kv head i // (heads // kv_heads) (GQA without repeating k/v); cu_seqlens int32 on the
device, [n + 1] starting at 0; out [total_q, heads, head_dim] in the input dtype; lse
[heads, total_q] fp32, natural log of the row sums of exp(q k^T * scale) (the "unpadded" varlen
layout: flash-attn 2.6 and later, PyTorch's copy); fp16/bf16 only, head_dim a multiple of 8 and at
most 256, compute capability 8.0 or newer; causal masks align to the bottom-right corner when
seqlen_q != seqlen_k (flash-attn >= 2.1), irrelevant here since causal pairs are square (asserted).

fp32 (and fp64) inputs are not supported by these kernels: for them `available` is False and the
caller keeps the per-group path of ops/attention.py (`_sparse_forward` / `_sparse_backward`).
A gradient flowing into the lse (`dlse`) has no input in the flash backward either; such a
backward also stays on the per-group path.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch

from .segments import SegmentPlan
from .varlen_rounds import varlen_rounds

NEG_INF = float("-inf")
_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_FLASH_ATTN_MIN = (2, 6)  # first flash-attn with the unpadded [heads, total_q] varlen lse


# ----------------------------------------------------------------------------------------------
# Kernel selection: flash-attn (>= 2.6) if installed, else PyTorch's flash op


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


# What we pass to flash-attn's `_flash_attn_varlen_backward`, by parameter name; its signature
# changed between releases (window_size -> window_size_left/right, softcap, ...).
_FLASH_BWD_ARGS = {
    "dropout_p": 0.0,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "rng_state": None,
}
_FLASH_BWD_TENSORS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                      "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "deterministic")


def _parameters(fn) -> list[inspect.Parameter]:
    # flash-attn wraps its ops in torch.library.custom_op: the Python function is `_init_fn`.
    return list(inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values())


@functools.cache
def _flash_attn_functions():
    """(flash_attn_varlen_func, _flash_attn_varlen_backward, its parameter names) or None."""
    try:  # flash-attn is optional (the `gpu` extra)
        import flash_attn
        from flash_attn import flash_attn_interface as fai
    except (ImportError, OSError, RuntimeError):  # not installed, or a build that does not load
        return None
    if _version(getattr(flash_attn, "__version__", "0")) < _FLASH_ATTN_MIN:
        return None  # older releases return the varlen lse padded, [batch, heads, max_seqlen_q]
    fwd = getattr(fai, "flash_attn_varlen_func", None)
    bwd = getattr(fai, "_flash_attn_varlen_backward", None)
    if fwd is None or bwd is None:
        return None
    try:
        params = _parameters(bwd)
    except (TypeError, ValueError):
        return None
    known = set(_FLASH_BWD_ARGS) | set(_FLASH_BWD_TENSORS)
    if any(p.default is inspect.Parameter.empty and p.name not in known for p in params):
        return None  # a release whose backward wants something we do not know how to give
    return fwd, bwd, tuple(p.name for p in params)


@functools.cache
def _backend() -> str | None:
    """'flash_attn', 'aten' or None: which varlen kernel this process calls."""
    if torch.version.hip:
        return None  # other kernels there (CK / aotriton), contracts not checked here
    if _flash_attn_functions() is not None:
        return "flash_attn"
    if torch.backends.cuda.is_flash_attention_available():
        return "aten"
    return None


def _aten_ops():
    return torch.ops.aten


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def available(q: torch.Tensor) -> bool:
    """Whether the varlen path applies to queries `q` [batch, seq, heads, head_dim]: a CUDA tensor
    in fp16/bf16 with head_dim a multiple of 8 and at most 256, on an sm80+ GPU, with a flash
    kernel at hand. Otherwise use the per-group path of ops/attention.py."""
    if q.device.type != "cuda" or q.dtype not in _HALF:
        return False
    d = q.shape[-1]
    if d % 8 or d > _MAX_HEAD_DIM:
        return False
    if _backend() is None:
        return False
    return _capability_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _kernel_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """One varlen flash forward: q [total_q, h, d], k/v [total_k, kv, d], int32 cu_seqlens on the
    device -> (out [total_q, h, d] in q's dtype, lse [h, total_q] fp32)."""
    h, kvh = q.shape[1], k.shape[1]
    if max_q == 1 and h != kvh:
        # With max_seqlen_q == 1 and GQA the kernels switch to a decode layout (query-head groups
        # swapped into the sequence axis) whose lse ordering we do not rely on; max_seqlen_q is an
        # upper bound (per-sequence lengths come from cu_seqlens), so 2 is equally correct.
        max_q = 2
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    backend = _backend()
    with torch.no_grad():
        if backend == "flash_attn":
            fwd = _flash_attn_functions()[0]
            out, lse, _ = fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                              causal=causal, return_attn_probs=True)
        elif backend == "aten":
            out, lse, *_ = _aten_ops()._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        else:
            raise RuntimeError("no variable-length flash-attention kernel here (CUDA with flash-attn >= 2.6 or "
                               "PyTorch's flash attention); check varlen.available() first")
    if tuple(lse.shape) != (h, q.shape[0]):
        raise RuntimeError(f"varlen flash kernel ({backend}) returned lse of shape {tuple(lse.shape)}, expected "
                           f"[heads, total_q] = {(h, q.shape[0])}")
    return out, lse.float()


def _kernel_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """One varlen flash backward from the given out and lse [h, total_q] fp32 (which may be those
    of a larger attention this call is a block of) -> (dq, dk [total_k, kv, d], dv) in q's dtype."""
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    lse = lse.float().contiguous()
    backend = _backend()
    with torch.no_grad():
        if backend == "flash_attn":
            _, bwd, names = _flash_attn_functions()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            given = dict(_FLASH_BWD_ARGS, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                         softmax_scale=scale, causal=causal,
                         deterministic=torch.are_deterministic_algorithms_enabled())
            bwd(**{name: given[name] for name in names if name in given})  # writes dq, dk, dv
        elif backend == "aten":
            rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
            unused = torch.empty(0, device=q.device)
            dq, dk, dv = _aten_ops()._flash_attention_backward(
                dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)
        else:
            raise RuntimeError("no variable-length flash-attention kernel here; check varlen.available() first")
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Execution


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _rows(flat: torch.Tensor, index: torch.Tensor, identity: bool) -> torch.Tensor:
    return flat if identity else flat.index_select(0, index)


def _check(q, k, v, plan: SegmentPlan):
    b, sq = q.shape[:2]
    if (plan.batch, plan.seq_q, plan.seq_k) != (b, sq, k.shape[1]):
        raise ValueError(f"plan for [batch, seq_q, seq_k] = {(plan.batch, plan.seq_q, plan.seq_k)} does not fit "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape != v.shape or q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")


def varlen_forward(q, k, v, plan: SegmentPlan, scale: float):
    """Attention of every pair of `plan` with one varlen call per round.

    q [b, sq, h, d], k/v [b, sk, kv, d] -> (out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32).
    Rows that see no key: out 0, lse -inf. Rows in several rounds are merged in fp32 with their lse."""
    _check(q, k, v, plan)
    b, sq, h, d = q.shape
    n = b * sq
    rounds = varlen_rounds(plan).on(q.device)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    if len(rounds) == 1 and rounds[0].q_identity:
        r = rounds[0]  # every row in one call, in order: its results are the answer
        o, l_ = _kernel_forward(qf, _rows(kf, r.k_index, r.k_identity), _rows(vf, r.k_index, r.k_identity),
                                r.cu_seqlens_q, r.cu_seqlens_k, r.max_seqlen_q, r.max_seqlen_k, r.causal, scale)
        return o.to(q.dtype).view(b, sq, h, d), l_.view(h, b, sq).transpose(0, 1).contiguous()
    merge = plan.multi
    out = torch.zeros((n, h, d), dtype=torch.float32 if merge else q.dtype, device=q.device)
    lse = torch.full((h, n), NEG_INF, dtype=torch.float32, device=q.device)  # the kernels' layout
    for r in rounds:
        o, l_ = _kernel_forward(_rows(qf, r.q_index, r.q_identity), _rows(kf, r.k_index, r.k_identity),
                                _rows(vf, r.k_index, r.k_identity), r.cu_seqlens_q, r.cu_seqlens_k,
                                r.max_seqlen_q, r.max_seqlen_k, r.causal, scale)
        if not merge:
            out.index_copy_(0, r.q_index, o.to(out.dtype))
            lse.index_copy_(1, r.q_index, l_)
            continue
        old = lse.index_select(1, r.q_index)
        new = torch.logaddexp(old, l_)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        w_old = torch.exp(old - safe).transpose(0, 1)[..., None]  # [rows, h, 1]
        w_new = torch.exp(l_ - safe).transpose(0, 1)[..., None]
        merged = out.index_select(0, r.q_index) * w_old + o.float() * w_new
        out.index_copy_(0, r.q_index, merged)
        lse.index_copy_(1, r.q_index, new)
    return out.to(q.dtype).view(b, sq, h, d), lse.view(h, b, sq).transpose(0, 1).contiguous()


def varlen_backward(dout, q, k, v, out, lse, plan: SegmentPlan, scale: float, dlse=None):
    """Gradients (dq, dk, dv) of varlen_forward from `out` and `lse`, which may be the *global*
    output and lse of a larger attention this plan is one block of (ring attention): every round's
    backward recomputes its probabilities as exp(S - lse) and its row term from (dout, out), so the
    result is this block's share of the global gradients. Accumulated in fp32 across rounds.

    `dlse` is not supported (the flash backward has no input for it): pass None, or use the
    per-group path."""
    if dlse is not None:
        raise NotImplementedError("the varlen flash backward takes no lse gradient; use the per-group path")
    _check(q, k, v, plan)
    b, sq, h, _ = q.shape
    n = b * sq
    rounds = varlen_rounds(plan).on(q.device)
    qf, kf, vf, of, dof = _flat(q), _flat(k), _flat(v), _flat(out), _flat(dout)
    lse_t = lse.transpose(0, 1).reshape(h, n).float()  # [h, tokens]: the kernels' layout
    if len(rounds) == 1 and rounds[0].q_identity and rounds[0].k_identity:
        r = rounds[0]  # one call over every row and key in order: its gradients are the answer
        dq, dk, dv = _kernel_backward(dof, qf, kf, vf, of, lse_t, r.cu_seqlens_q, r.cu_seqlens_k,
                                      r.max_seqlen_q, r.max_seqlen_k, r.causal, scale)
        return dq.to(q.dtype).view(q.shape), dk.to(k.dtype).view(k.shape), dv.to(v.dtype).view(v.shape)
    dq = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    for r in rounds:
        gl = lse_t if r.q_identity else lse_t.index_select(1, r.q_index)
        gq, gk, gv = _kernel_backward(
            _rows(dof, r.q_index, r.q_identity), _rows(qf, r.q_index, r.q_identity),
            _rows(kf, r.k_index, r.k_identity), _rows(vf, r.k_index, r.k_identity),
            _rows(of, r.q_index, r.q_identity), gl, r.cu_seqlens_q, r.cu_seqlens_k,
            r.max_seqlen_q, r.max_seqlen_k, r.causal, scale)
        dq.index_add_(0, r.q_index, gq.float())
        dk.index_add_(0, r.k_index, gk.float())  # a key segment may serve several pairs of a round
        dv.index_add_(0, r.k_index, gv.float())
    return dq.to(q.dtype).view(q.shape), dk.to(k.dtype).view(k.shape), dv.to(v.dtype).view(v.shape)
