"""The pieces of one training step that the loop, the planner's validation and the benchmarks share.

Seeding, device and precision choice, the learning-rate schedule, the optimizer, the loss forward
and gradient clipping. Nothing here knows about runs, data stores, metrics or checkpoints: that is
the training loop's business (train.py), and the planner must be able to measure a step without it.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from ..errors import ConfigError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(choice: str, option: str = "train.device") -> torch.device:
    """auto | cpu | cuda -> the device; `option` names the setting in the error (a CLI flag elsewhere)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}=cuda but no CUDA device is available; use {option}=auto or cpu.")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step (step is 0-based)."""
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms): the fused kernel on CUDA (one launch
    for all parameters), the multi-tensor (foreach) one elsewhere."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=cuda, foreach=not cuda)


def guarded_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step(), unless `finite` (a 0-d bool tensor, the same on every rank: it comes from the
    global loss and gradient norm) is False, in which case parameters, moments and step counts stay
    exactly as they were. With the fused AdamW the decision stays on the device: the kernel takes
    `found_inf` and skips the update itself (as under a gradient scaler), so nothing waits for the
    device; the foreach AdamW is used on CPU only, where reading the flag is no device sync."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).to(torch.float32)
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
    elif bool(finite):
        optimizer.step()


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Under FSDP2: reduce-scatter (and, with HSDP, all-reduce) the gradients at the end of this
    backward, or keep accumulating them unsharded on each rank. Gradient accumulation turns it off
    for every micro-batch but the last, so gradients cross the network once per optimizer step
    (at the cost of holding this rank's unsharded gradients between micro-batches)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def forward_loss_sum(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The summed loss over the batch's valid label tokens (the caller normalises)."""
    with torch.autocast(device_type=batch.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="sum")


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (over all shards, a tensor left on the device: reading it is the
    caller's choice) and clipping to max_norm (0 = no clipping)."""
    params = [p for p in model.parameters() if p.grad is not None]
    # DTensor gradients live on one mesh per kind (FSDP's, and the experts' under expert
    # parallelism): each group's norm is computed on its own mesh, then combined
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], norm_type=2.0, foreach=True)
        if hasattr(norm, "full_tensor"):  # sharded (DTensor) gradients: the norm is a partial result
            norm = norm.full_tensor()
        norms.append(norm)
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if max_norm > 0:
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, norm, foreach=True)
    return norm
