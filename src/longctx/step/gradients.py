"""Gradients of a step under FSDP2: their synchronisation under accumulation (memory.grad_sync) and
their global norm and clipping over every mesh the shards live on."""

from __future__ import annotations

import torch


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Under FSDP2: reduce-scatter (and, with HSDP, all-reduce) the gradients at the end of this
    backward, or keep accumulating them unsharded on each rank. Gradient accumulation turns it off
    for every micro-batch but the last, so gradients cross the network once per optimizer step
    (at the cost of holding this rank's unsharded gradients between micro-batches). A one-rank FSDP
    group (memory.model_states = host at world 1) always reduces: there is no traffic to save, and
    deferring would keep the whole model's fp32 gradients on the device, where that tier (and its
    accounting, costs/host_bytes.py) has none: each micro-batch's gradients go to host memory."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled or _one_rank_fsdp(model))


def _one_rank_fsdp(model: torch.nn.Module) -> bool:
    """Whether the model's FSDP states are sharded over a one-rank mesh (nothing to reduce across)."""
    mesh = getattr(next(model.parameters(), None), "device_mesh", None)
    return mesh is not None and mesh.size() == 1


def clip_step_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """clip_gradients of the step's gradients: the model's, or, where the optimizer keeps them in host
    memory (step/host_optimizer.py, whose weights hold none after backward), the optimizer's."""
    own = getattr(optimizer, "clip_gradients", None)
    return own(max_norm) if own is not None else clip_gradients(model, max_norm)


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
