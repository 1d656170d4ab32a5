"""The independent reference of tests/unit/test_optim_fuzz117.py: the optimizer step as a whole, in float64, written
from the words of the docs and of the papers, not from longctx's code:

- the learning rate of 1-based step s (`reference_lr`), from step/schedule.py's and docs/running.md's words: a linear
  warmup of W steps to train.lr (step s <= W trains at lr x s / W), then the decay of train.lr_schedule from train.lr
  at the 0-based decay start (the warmup's end, or, under a train.lr_decay_fraction f below 1, the step from which
  round(f x steps) updates, halves up, are left to the run's last step, whichever is later) to lr x min_lr_ratio at
  the last step, exactly; cosine 0.5 (1 + cos(pi p)), linear 1 - p, 1-sqrt 1 - sqrt(p) (Hägele et al. 2024) of the
  decay's progress p; constant: lr after the warmup. A resume recomputes it over its own settings from step 1;
- the loss (`reference_gradients`): the float64 model's logits (tests/memory_fuzz_reference.py's attention written
  there), torch's cross-entropy per label, each weighted as train.loss_weighting says (token: 1, over the step's label
  count; sequence: 1 / N_k for a label of sequence k, over the step's K sequences, LongAlign), summed over the step's
  micro-batches: the mean over the step, whatever grad_accum;
- clipping (`clipped`): the global L2 norm over every parameter, gradients times max_norm / (norm + 1e-6) where that
  is below 1 (torch.nn.utils.clip_grad_norm_'s documented rule); 0 = none;
- AdamW (`ReferenceAdamW`): Loshchilov & Hutter's decoupled weight decay as torch.optim.AdamW documents it,
  theta <- theta (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; theta <- theta - lr (m / (1 - b1^t))
  / (sqrt(v / (1 - b2^t)) + eps), t counting the updates made (a checkpoint's t continues); decay on matrices only
  (embeddings, projections: train.weight_decay's help), never on norms or biases; a tied embedding is one matrix,
  decayed once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longctx.models.llama import build_model
from memory_fuzz_reference import dense_document_attention

IGNORE = -100


def reference_lr(s: int, t) -> float:
    """The rate of 1-based step `s` under settings `t` (an object with train's schedule keys)."""
    if s <= t.warmup_steps:
        return t.lr * s / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    updates = max(1, int(math.floor(t.lr_decay_fraction * t.steps + 0.5 + 1e-9)))
    start = max(t.warmup_steps, t.steps - 1 - updates)  # 0-based, at the peak
    last = t.steps - 1
    if last <= start:  # (no step left to decay over: the run is all warmup, or one step)
        return t.lr
    p = min(1.0, max(0.0, (s - 1 - start) / (last - start)))
    shape = {"cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p, "1-sqrt": 1 - math.sqrt(p)}
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * shape[t.lr_schedule]


def decays(name: str) -> bool:
    """Whether train.weight_decay applies to parameter `name`: matrices yes, norms and biases no."""
    return not (name.endswith(".bias") or name.split(".")[-2].endswith("norm"))


def float64_model(cfg):
    """A plain float64 model of `cfg.model`'s shape, its attention the reference's."""
    model = build_model(cfg.model, "cpu", seed=0).double()
    for block in model.layers:
        block.attention.core = dense_document_attention
    return model


def _weights(micro, weighting: str) -> tuple[torch.Tensor, int]:
    """Each label's weight [rows, seq] and the micro-batch's count (labels, or sequences with a label)."""
    scored = micro.labels != IGNORE
    if weighting == "token":
        return scored.double(), int(scored.sum())
    docs = torch.zeros_like(micro.labels) if micro.doc_ids is None else micro.doc_ids
    weights = torch.zeros(scored.shape, dtype=torch.float64)
    count = 0
    for r in range(scored.shape[0]):
        for d in set(docs[r].tolist()):
            members = scored[r] & (docs[r] == d)
            if members.any():
                weights[r][members] = 1.0 / int(members.sum())
                count += 1
    return weights, count


def reference_gradients(model, weights: dict, micros: list, weighting: str) -> tuple[float, dict]:
    """(loss, {name: gradient}) of the step over `micros` at `weights` (float64 tensors by name)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    shares = [_weights(m, weighting) for m in micros]
    denominator = max(1, sum(n for _, n in shares))
    loss = torch.zeros((), dtype=torch.float64)
    for m, (w, _) in zip(micros, shares):
        logits = model(m.tokens, m.positions, m.doc_ids)
        ce = F.cross_entropy(logits.flatten(0, 1), m.labels.flatten(), ignore_index=IGNORE, reduction="none")
        loss = loss + (ce * w.flatten()).sum() / denominator
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()], allow_unused=True)
    return float(loss.detach()), {n: torch.zeros_like(weights[n]) if g is None else g for n, g in zip(names, grads)}


def global_norm(grads: dict) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


def clipped(grads: dict, max_norm: float) -> dict:
    if max_norm <= 0:
        return grads
    coef = min(1.0, max_norm / (global_norm(grads) + 1e-6))
    return {n: g * coef for n, g in grads.items()}


class ReferenceAdamW:
    """AdamW over float64 copies of the weights, by name (see the module's docstring)."""

    def __init__(self, weights: dict):
        self.w = {n: w.double().clone() for n, w in weights.items()}
        self.m = {n: torch.zeros_like(w) for n, w in self.w.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.w.items()}
        self.t = 0

    def step(self, grads: dict, lr: float, wd: float, b1: float, b2: float, eps: float) -> None:
        self.t += 1
        for n, w in self.w.items():
            g = grads[n].double()
            if decays(n):
                w.mul_(1 - lr * wd)
            self.m[n] = b1 * self.m[n] + (1 - b1) * g
            self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
            m_hat = self.m[n] / (1 - b1 ** self.t)
            v_hat = self.v[n] / (1 - b2 ** self.t)
            w.sub_(lr * m_hat / (v_hat.sqrt() + eps))

    def copy(self) -> ReferenceAdamW:
        other = ReferenceAdamW(self.w)
        other.m = {n: m.clone() for n, m in self.m.items()}
        other.v = {n: v.clone() for n, v in self.v.items()}
        other.t = self.t
        return other


def expected_note(saved, now, step: int) -> tuple[float, float] | None:
    """(the new rate, the saved settings' rate) of the resumed step `step` + 1 when they differ (a note is due),
    else None."""
    was, new = reference_lr(step + 1, saved), reference_lr(step + 1, now)
    return None if math.isclose(was, new, rel_tol=1e-9) else (new, was)
