"""The independent reference of tests/unit/test_memory_fuzz116.py: one training step of a model computed in
float64 by the plain model class (no memory policy: every block's forward as models/llama.py writes it), with

- attention: per-document causal softmax attention written here (`dense_document_attention`: a query sees the
  keys at or before it in its own document; grouped-query heads by repetition), in place of ops/attention.py;
- the loss: torch's cross-entropy over the full logits, each label weighted as train.loss_weighting documents
  (token: 1 each, the step's sum over its labels; sequence: 1 / its sequence's labels, the sum over the step's
  trained sequences, LongAlign; a sequence is a document of a row, a row without document masks), counted here
  (`label_weights`), not by data/sequence_weights.py; the MoE balancing losses as a mean over the micro-batches
  (train/moe_hooks.py's documented term);
- the step: the global norm, clipping by max_norm / (norm + 1e-6) when above (torch's clip_grad_norm_ rule), and
  AdamW's first update in closed form: p (1 - lr wd [matrices]) - lr g / (|g| + eps) (the bias corrections
  cancel the moments' (1 - beta) factors at step 1).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from longctx.models.moe import moe_layers

IGNORE = -100


def dense_document_attention(q, k, v, doc_ids):
    """out [b, s, h, d] of softmax(q k^T / sqrt(d)) v over the keys each query sees: causal, same document."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
    seen = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if doc_ids is not None:
        seen = seen & (doc_ids[:, :, None] == doc_ids[:, None, :])
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double()).to(q.dtype)


def label_weights(micro, weighting: str) -> tuple[torch.Tensor, int]:
    """([rows, seq] float64 weight of each label, 0 where ignored; the micro-batch's denominator share): token:
    1 each and the labels counted; sequence: 1 / N_k for sequence k's N_k labels and the sequences counted."""
    scored = micro.labels != IGNORE
    if weighting == "token":
        return scored.double(), int(scored.sum())
    weights = torch.zeros(scored.shape, dtype=torch.float64)
    sequences = 0
    for r in range(scored.shape[0]):
        docs = torch.zeros_like(micro.labels[r]) if micro.doc_ids is None else micro.doc_ids[r]
        for d in docs.unique().tolist():
            members = scored[r] & (docs == d)
            if members.any():
                weights[r][members] = 1.0 / int(members.sum())
                sequences += 1
    return weights, sequences


def float64_model(model):
    """A float64 copy of a plain model (built with no policy), its attention the one written here."""
    ref = copy.deepcopy(model).double()
    for block in ref.layers:
        assert "forward" not in vars(block), "the reference must be a model no memory policy was applied to"
        block.attention.core = dense_document_attention
    assert ref.loss_chunk == 0
    return ref


def reference_step(ref, micros, case: dict) -> dict:
    """The step of float64 model `ref` on `micros`: its loss (the trainer's: the weighted sum over the step's
    denominator, without balancing terms), every parameter's gradient of the loss plus the balancing terms, their
    global norm, and the denominator (`labels`: 0 when every label is ignored, a step with no loss)."""
    shares = [label_weights(m, case["weighting"]) for m in micros]
    denominator = max(sum(n for _, n in shares), 1)
    for layer in moe_layers(ref):
        layer.router.step = 0
    loss = objective = torch.zeros((), dtype=torch.float64)
    for m, (weights, _) in zip(micros, shares):
        h = ref.hidden_states(m.tokens, m.positions, m.doc_ids, real=m.real)
        logits = F.linear(h, ref.lm_head_weight).flatten(0, 1)
        ce = F.cross_entropy(logits, m.labels.flatten(), ignore_index=IGNORE, reduction="none")
        part = (ce * weights.flatten()).sum() / denominator
        loss = loss + part
        terms = ref.router_terms()
        objective = objective + part + (0.0 if terms is None else terms.loss / len(micros))
    names = [n for n, _ in ref.named_parameters()]
    grads = torch.autograd.grad(objective, [p for _, p in ref.named_parameters()], allow_unused=True)
    grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(ref.named_parameters(), grads)}
    norm = torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt()
    return {"loss": loss.detach(), "grads": dict(zip(names, grads.values())), "norm": float(norm),
            "labels": sum(n for _, n in shares)}


def clipped(grads: dict, norm: float, max_norm: float) -> dict:
    if max_norm <= 0:
        return grads
    coef = min(1.0, max_norm / (norm + 1e-6))
    return {n: g * coef for n, g in grads.items()}


def adamw_first_step(params: dict, grads: dict, lr: float, weight_decay: float, eps: float) -> dict:
    """Every parameter after AdamW's first update with these gradients (decay on matrices only, make_optimizer's
    groups)."""
    out = {}
    for n, p in params.items():
        decay = weight_decay if p.dim() >= 2 else 0.0
        g = grads[n]
        out[n] = p * (1 - lr * decay) - lr * g / (g.abs() + eps)
    return out
