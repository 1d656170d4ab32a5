"""The optimizer of a training step: AdamW (fused on CUDA, foreach on CPU), and its step skipped on
the device when the step's loss or gradient norm is not finite."""

from __future__ import annotations

import torch


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
