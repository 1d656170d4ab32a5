"""LM head + cross-entropy, optionally chunked over tokens so [tokens, vocab] logits never exist.

At long context the logits dominate: 128K tokens x a 128K vocabulary is 64 GiB in fp32, for one
matmul whose output is immediately reduced to one number per token. `lm_head_loss` with `chunk`
computes logits for `chunk` tokens at a time, reduces them to the log-sum-exp and the target
logit, and keeps only those (8 bytes per token) for backward. The backward recomputes each chunk's
logits (one extra [chunk, dim] x [dim, vocab] matmul per chunk, ~2% of an 8B model's step) and
turns them straight into the hidden-state gradient and the accumulated weight gradient.

With `norm` = (weight, eps), h is the last block's output and the final RMSNorm runs inside,
per chunk: forward keeps only h (alive anyway) and backward recomputes each chunk's norm, so the
norm's fp32 statistics (8 x dim bytes per token) never exist for all tokens at once either.

Numerics match `F.cross_entropy(F.linear(norm(h), w).float(), labels)`: logits in the compute
dtype (autocast's when active), softmax statistics in fp32, labels == -100 ignored.

With `rows` (the index of the rows whose label is scored, `scored_rows`, made on the host before the
batch's copy to the device) the head runs over those rows only: an SFT sample whose prompt is masked,
an answer-only synthetic sample or a padded one pays the head, its matmul with the whole vocabulary,
for the labels it scores, not for every position. Same loss and gradients (the other rows' are zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_norm

IGNORE = -100


def lm_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int = 0,
                 reduction: str = "mean", norm: tuple[torch.Tensor, float] | None = None,
                 label_weights: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of `labels` [n] under logits norm(h) [n, dim] @ weight [vocab, dim]^T.

    chunk = 0, or n <= chunk: the plain path (one logits tensor). Otherwise chunked as above.
    reduction: "sum" or "mean" (over labels != -100). norm: (RMSNorm weight, eps), or None for none.
    label_weights: [n] float, each label's weight in the sum (train.loss_weighting = sequence: 1 / its sequence's
    labels, data/sequence_weights.py); "mean" then divides by the weights' sum over valid labels.
    rows: int64 [m], the rows to score (`scored_rows`: every row whose label is not ignored, ascending); the
    head then runs over those m rows only."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if h.dim() != 2 or labels.shape != h.shape[:1] or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"lm_head_loss expects h [n, dim], weight [vocab, dim], labels [n]; got "
                         f"{tuple(h.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    _check_labels(labels, weight.shape[0])
    if label_weights is not None and label_weights.shape != labels.shape:
        raise ValueError(f"lm_head_loss's label_weights must be one per label, {tuple(labels.shape)}; got "
                         f"{tuple(label_weights.shape)}")
    if rows is not None:
        h, labels, label_weights = take_rows(rows, h, labels, label_weights)
    if chunk <= 0 or h.shape[0] <= chunk:
        if norm is not None:
            h = rms_norm(h, *norm)
        # summed, then divided as the chunked path divides: a mean over no valid label is 0 with zero
        # gradients on both paths (F.cross_entropy's own mean gives NaN there)
        logits = F.linear(h, weight).to(_stat_dtype(h))
        if label_weights is None:
            total = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        else:
            each = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
            total = (each * _valid_weights(labels, label_weights, each.dtype)).sum()
    else:
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else None
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        total = _ChunkedLoss.apply(h, weight, labels, chunk, dtype, norm_weight, eps, label_weights)
    if reduction == "sum":
        return total
    if label_weights is None:
        return total / (labels != IGNORE).sum().clamp(min=1)
    return total / _valid_weights(labels, label_weights, total.dtype).sum().clamp(min=torch.finfo(total.dtype).tiny)


# The head runs over the scored rows only when at most this share of the rows is scored: above it the rows'
# copy (and its backward's scatter) costs about what it saves. Measured on CPU (docs/benchmarks.md, "The LM
# head over the scored rows only"): a step at 0.5 scored takes 0.68x the time, at 0.9 0.91-1.02x, at 0.97 1.05x.
SCORED_SHARE_MAX = 0.8


def scored_rows(labels: torch.Tensor) -> torch.Tensor | None:
    """The flat index (int64, ascending) of `labels`' rows that are scored, for lm_head_loss's `rows`; None when
    more than SCORED_SHARE_MAX of them are (the plain path is then as fast). `labels` must be on the host: the
    index is made there, before the batch's copy to the device, so no step waits for the device to count."""
    if labels.device.type != "cpu":
        raise ValueError(f"scored_rows reads labels on the host (a device tensor would make the step wait for it); "
                         f"got labels on {labels.device}")
    flat = labels.reshape(-1)
    keep = (flat != IGNORE).nonzero().squeeze(1)
    return keep if keep.numel() <= SCORED_SHARE_MAX * flat.numel() else None


def take_rows(rows, h, labels, label_weights):
    """The scored rows of h [n, dim], labels [n] and label weights [n] (or None). A row left out whose label is
    scored would drop that label from the loss without a word: checked on the device (no host read)."""
    taken = labels.index_select(0, rows)
    torch._assert_async((taken != IGNORE).sum() == (labels != IGNORE).sum(),
                        "lm_head_loss's rows leave out a scored label (rows must hold every row whose label is not "
                        f"{IGNORE}: scored_rows)")
    weights = None if label_weights is None else label_weights.index_select(0, rows)
    return h.index_select(0, rows), taken, weights


def _valid_weights(labels: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each label's weight, 0 where it is ignored (whatever the weights hold there)."""
    return torch.where(labels != IGNORE, weights.to(dtype), 0.0)


@torch.no_grad()
def lm_head_token_scores(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int = 0,
                         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Per token, [n, 2]: the label's negative log-likelihood and 1.0 where the label is the greedy
    (argmax) choice; both 0 where labels == -100. Forward only (evaluation); chunked like the loss,
    so [tokens, vocab] logits never exist beyond one chunk. Only the scored rows go through the head: a
    retrieval task scores a few answer tokens of a 128K-token prompt, and the head over every position was
    ~6% of an 8B model's forward with a 128K vocabulary (one host read for their count: evaluation keeps no
    step in flight behind it)."""
    _check_labels(labels, weight.shape[0])
    rows = (labels != IGNORE).nonzero().squeeze(1)
    if len(rows) < labels.shape[0]:
        out = torch.zeros(labels.shape[0], 2, dtype=_stat_dtype(h), device=h.device)
        out[rows] = lm_head_token_scores(h[rows], weight, labels[rows], chunk=chunk, norm=norm)
        return out
    n = h.shape[0]
    out = torch.zeros(n, 2, dtype=_stat_dtype(h), device=h.device)
    step = chunk if chunk > 0 else max(n, 1)
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else None
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, n, step):
            e = min(s + step, n)
            logits = _logits(_normed(h[s:e], norm_weight, eps), weight, dtype)
            lab = labels[s:e]
            valid = lab != IGNORE
            target = logits.gather(1, lab.clamp(min=0)[:, None]).squeeze(1)
            nll = torch.logsumexp(logits, dim=-1) - target
            hit = logits.argmax(dim=-1) == lab  # greedy's choice (argmax: the first of tied maxima, as generate's)
            out[s:e, 0] = torch.where(valid, nll, 0.0)
            out[s:e, 1] = (hit & valid).to(out.dtype)
    return out


def _check_labels(labels: torch.Tensor, vocab: int) -> None:
    """Refuse labels outside [0, vocab) other than IGNORE. The chunked paths gather the target logit
    at labels.clamp(min=0), so a negative label such as -1 (another ignore convention) would silently
    be scored as token 0 (F.cross_entropy, the plain path, raises). _assert_async: no host read on
    CUDA (a device-side assert there), an immediate error on the CPU; traceable by torch.compile."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != IGNORE)
    torch._assert_async(~bad.any(), f"labels must be token ids in [0, {vocab}) or {IGNORE} (ignored)")


def _stat_dtype(h):
    return torch.promote_types(h.dtype, torch.float32)  # fp32 softmax statistics (fp64 stays fp64)


def _logits(h, weight, dtype):
    stat = _stat_dtype(h)
    if dtype is not None:
        h, weight = h.to(dtype), weight.to(dtype)
    return (h @ weight.t()).to(stat)


def _normed(x, norm_weight, eps):
    return x if norm_weight is None else rms_norm(x, norm_weight, eps)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, dtype, norm_weight, eps, weights=None):
        n = h.shape[0]
        lse = torch.empty(n, dtype=_stat_dtype(h), device=h.device)
        total = torch.zeros((), dtype=_stat_dtype(h), device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                logits = _logits(_normed(h[s:e], norm_weight, eps), weight, dtype)
                lse[s:e] = torch.logsumexp(logits, dim=-1)
                lab = labels[s:e]
                target = logits.gather(1, lab.clamp(min=0)[:, None]).squeeze(1)
                scale = _label_scale(lab, weights, s, e, total.dtype)
                total += torch.where(lab != IGNORE, scale * (lse[s:e] - target), 0.0).sum()
                del logits
        ctx.save_for_backward(h, weight, labels, lse, norm_weight, weights)
        ctx.chunk, ctx.dtype, ctx.eps = chunk, dtype, eps
        return total

    @staticmethod
    def backward(ctx, grad):
        h, weight, labels, lse, norm_weight, weights = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        n = h.shape[0]
        dh = torch.empty_like(h)
        # (a frozen LM head, as a GliDe draft's: no weight gradient to accumulate)
        dw = torch.zeros(weight.shape, dtype=_stat_dtype(weight), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        dnorm = None if norm_weight is None else torch.zeros_like(norm_weight, dtype=_stat_dtype(norm_weight))
        mm = dtype or h.dtype
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                lab = labels[s:e]
                scale = _label_scale(lab, weights, s, e, lse.dtype)  # (0 for an ignored label)
                x = h[s:e]
                if norm_weight is not None:  # recompute this chunk's norm, with a graph for its backward
                    x = x.detach().requires_grad_()
                    w_n = norm_weight.detach().requires_grad_()
                    with torch.enable_grad():
                        xn = rms_norm(x, w_n, ctx.eps)
                else:
                    xn = x
                # d loss / d logits = softmax - onehot(label), zero for ignored tokens
                probs = torch.exp_(_logits(xn.detach(), weight, dtype).sub_(lse[s:e, None]))
                # (a scatter, not a boolean mask: a mask's size would be read from the device)
                probs.scatter_add_(1, lab.clamp(min=0)[:, None], -(lab != IGNORE).to(probs.dtype)[:, None])
                probs.mul_((scale.to(probs.dtype) * grad)[:, None])
                g = probs.to(mm)
                del probs
                dxn = (g @ weight.to(mm)).to(h.dtype)
                if dw is not None:
                    _add_weight_grad(dw, g, xn.detach().to(mm), chunk)
                if norm_weight is None:
                    dh[s:e] = dxn
                else:
                    dx, dwn = torch.autograd.grad(xn, (x, w_n), dxn)
                    dh[s:e] = dx
                    dnorm += dwn
                # this chunk's logits gradient goes now: kept until `g` is rebound, it lived beside the next
                # chunk's logits (in bf16 three chunk x vocab tensors at once, where memory/transients.py
                # lm_head_bytes counts one in the compute dtype and one in fp32)
                del g, dxn
        return (dh, None if dw is None else dw.to(weight.dtype), None, None, None,
                None if dnorm is None else dnorm.to(norm_weight.dtype), None, None)


def _add_weight_grad(dw: torch.Tensor, g: torch.Tensor, xn: torch.Tensor, chunk: int) -> None:
    """dw (fp32) += g^T xn, one chunk's LM-head weight gradient. In fp32 (no autocast) in place. Under
    autocast the product is the compute dtype's matmul, as autograd's weight gradient of an autocast linear
    is, then added to dw in fp32: an fp32 matmul was ~10x the bf16 one's time on a GPU (an H200's CUDA
    cores, TF32 off), 9 us of llama3-1b's ~46 us a token (docs/benchmarks.md, peer). The product's
    [vocab, dim] is taken in row pieces no larger than the chunk's fp32 logits gradient just freed
    (chunk x vocab x 4 B, memory/transients.py lm_head_bytes), one piece where dim x 2 <= 4 x chunk."""
    if g.dtype == dw.dtype:
        dw.addmm_(g.t(), xn)
        return
    vocab, dim = dw.shape
    rows = max(1, min(vocab, vocab * 4 * chunk // (dim * g.element_size())))
    for r in range(0, vocab, rows):
        dw[r:r + rows].add_(g[:, r:r + rows].t() @ xn)


def _label_scale(lab: torch.Tensor, weights: torch.Tensor | None, s: int, e: int, dtype) -> torch.Tensor:
    """Chunk [s, e)'s labels' factors in the sum: 1 (or the label's weight) where valid, else 0."""
    valid = lab != IGNORE
    return valid.to(dtype) if weights is None else torch.where(valid, weights[s:e].to(dtype), 0.0)


def lm_head_distill_loss(h: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *,
                         temperature: float = 1.0, chunk: int = 0,
                         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Distillation through one shared LM head: the cross-entropy -sum_v p(v) log q(v) of the student's
    distribution q = softmax(norm(h) @ weight^T / T) against the teacher's p = softmax(teacher @
    weight^T / T), summed over the tokens whose labels are not -100 (h [n, dim] the student's last
    hidden states, teacher [n, dim] the teacher's final-normed ones, no gradient to it).

    With chunk > 0 the tokens go `chunk` at a time, each chunk checkpointed: its two [chunk, vocab]
    logits exist in forward only while its term is computed, and in backward are recomputed, one
    chunk at a time, so neither model's [n, vocab] logits ever exist. Logits in the compute dtype
    (autocast's when active), softmax statistics in fp32, as lm_head_loss."""
    if h.dim() != 2 or teacher.shape != h.shape or labels.shape != h.shape[:1] or weight.shape[1] != h.shape[1]:
        raise ValueError(f"lm_head_distill_loss expects h and teacher [n, dim], weight [vocab, dim], labels [n]; got "
                         f"{tuple(h.shape)}, {tuple(teacher.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else None
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    teacher = teacher.detach()
    n = h.shape[0]
    if chunk <= 0 or n <= chunk:
        return _distill_chunk(h, teacher, labels, weight, norm_weight, eps, temperature, dtype)
    from torch.utils.checkpoint import checkpoint

    total = None
    for s in range(0, n, chunk):
        part = checkpoint(_distill_chunk, h[s:s + chunk], teacher[s:s + chunk], labels[s:s + chunk], weight,
                          norm_weight, eps, temperature, dtype, use_reentrant=False)
        total = part if total is None else total + part
    return total


def _distill_chunk(h, teacher, labels, weight, norm_weight, eps, temperature, dtype):
    with torch.autocast(h.device.type, enabled=False):
        student = _logits(_normed(h, norm_weight, eps), weight, dtype) / temperature
        with torch.no_grad():
            p = torch.softmax(_logits(teacher, weight, dtype) / temperature, dim=-1)
        ce = torch.logsumexp(student, dim=-1) - (p * student).sum(-1)
        return torch.where(labels != IGNORE, ce, 0.0).sum()
