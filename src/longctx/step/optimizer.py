"""The optimizer of a training step: AdamW (fused on CUDA and for states in host memory, foreach on a
CPU run), and its step skipped on the device when the step's loss or gradient norm is not finite."""

from __future__ import annotations

import torch

from .host_optimizer import HostOptimizer, forward_units


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms): the fused kernel on CUDA (one launch
    for all parameters) and under memory.model_states = host (torch's fused CPU AdamW: as fast per
    parameter as DeepSpeed's CPU Adam here, 5x the foreach one; benchmarks/cpu_adam.py), the
    multi-tensor (foreach) one on a CPU run otherwise (kept: its losses are the reference runs').
    Under memory.model_states = host_optimizer: HostOptimizer, the fused CPU AdamW over host masters."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    hyper = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps}
    if cfg.memory.model_states == "host_optimizer":  # the same AdamW, its state and step in host memory
        return HostOptimizer(groups, forward_units(model), **hyper)
    fused = next(model.parameters()).device.type == "cuda" or cfg.memory.model_states == "host"
    return torch.optim.AdamW(groups, **hyper, fused=fused, foreach=not fused)


def guarded_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step(), unless `finite` (a 0-d bool tensor, the same on every rank: it comes from the
    global loss and gradient norm) is False, in which case parameters, moments and step counts stay
    exactly as they were. With the fused AdamW the decision stays on the device: the kernel takes
    `found_inf` and skips the update itself (as under a gradient scaler), so nothing waits for the
    device; the foreach AdamW is used on CPU only, where reading the flag is no device sync. The
    flag goes where the parameters are (the host's, for states in host memory)."""
    if optimizer.defaults.get("fused"):
        where = optimizer.param_groups[0]["params"][0].device
        optimizer.found_inf = (~finite).to(device=where, dtype=torch.float32)
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
    elif bool(finite):
        optimizer.step()
    elif not optimizer.state:
        fresh_state(optimizer)


def fresh_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter given the state a skipped fused step leaves (the fused kernel makes it and undoes the
    step under found_inf): AdamW's step 0 and zero moments, which is what a first update starts from. The
    foreach AdamW makes none for a skipped step, and a checkpoint then saved would have DCP's get_state_dict
    make one by a step of zero gradients at lr 0 that it counts: every later update bias-corrected one
    step late (the first real one as the second, ~0.7x its size), the run not what it would be unsaved."""
    grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not torch.is_tensor(group["lr"]) else torch.zeros_like(group["lr"])
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
