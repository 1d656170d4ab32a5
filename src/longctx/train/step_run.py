"""One optimizer step of a Trainer (trainer.py): the micro-batches' forward and backward, the step's loss over
its global batch, clipping, the guard's decision and the update. Functions of the trainer, as read_back.py's
and rollback's are: the loop (trainer.py) decides when, this what a step does.

The loss of a step is the mean over every valid label of the global step (trainer.py's docstring says why):
each micro-batch's summed loss is divided by that count before its backward, so FSDP's summed gradients are
those of one large batch on one device.
"""

from __future__ import annotations

import torch

from ..job import watchdog
from ..parallel.context.shares import to_device
from ..parallel.fsdp.shard import grad_scale
from ..step.gradients import clip_step_gradients, set_gradient_sync
from ..step.loss import forward_loss_sum, step_mean
from ..step.optimizer import guarded_step
from ..step.schedule import lr_at


def run_step(trainer, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step (1-based): its loss over the global batch and the gradient norm, both
    left on the device (nothing in a step waits for the device), and the lr."""
    lr = lr_at(step - 1, trainer.cfg)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    watchdog.phase(step, "data")
    shares = trainer.sampler.step_batches(step)  # this rank's, read on the host (read ahead, mostly)
    valid = sum(v for _, v in shares)  # of the global step: the same on every rank
    if not valid:  # (a draft's count of the labels it scores is on the device, not read: label_count)
        trainer.log(f"step {step}: every label of its global batch is ignored: no loss (NaN), update not applied")
    micro = [to_device(b, trainer.device) for b, _ in shares]
    trainer.hooks.step_start(step)
    with trainer.device_section():
        valid = label_count(trainer, micro, valid)  # (a draft's reduced vocabulary scores fewer labels)
        local_loss = forward_backward(trainer, step, micro, valid)
        watchdog.phase(step, "optimizer")
        loss = step_mean(trainer.rt.sum_tensor(local_loss), valid)
        if trainer.co2 is not None:  # train.co2_sync_steps: a synchronous step's gradients averaged first
            trainer.co2.before_clip(step)
        # (with the gradients: in host memory under memory.model_states = host; the step's figures travel
        # together, on the device, to the guard and to read_back's one stack). Not blocking: a plain copy of
        # a host tensor to a GPU waits for the device's queue to drain (torch's memcpy_and_sync), a second
        # wait in the step besides the optimizer's flag (guarded_step); the norm is done (host code)
        grad_norm = clip_step_gradients(trainer.model, trainer.optimizer, trainer.cfg.train.grad_clip).to(
            loss.device, non_blocking=True)
        if trainer.co2 is not None:  # each replica clipped its own: the guard reads the largest
            grad_norm = trainer.co2.agreed_norm(grad_norm)
        # global figures, so the same decision on every rank
        apply, trainer.last_spike = trainer.guard.check(loss, grad_norm)
    # train.on_nonfinite: the update is applied only if the step's loss and gradient norm are
    # finite (and its loss no spike), decided on the device by the fused AdamW (guarded_step)
    guarded_step(trainer.optimizer, apply)
    trainer.step_counts.updated()  # (the update's part of the step counted once done: step_progress.py)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.hooks.after_optimizer(step, apply)
    return loss, grad_norm, lr


def label_count(trainer, micro: list, valid: int) -> int | torch.Tensor:
    """The labels the loss scores in `micro`'s global batches: `valid` (the store index's count), or where the model
    scores fewer (draft.vocab, loss ce: glide.py scored_label_count) its count over the ranks, on the device."""
    count = getattr(trainer.model, "scored_label_count", None)
    mine = [] if count is None else [count(b.labels) for b in micro]
    return valid if not mine or mine[0] is None else trainer.rt.sum_tensor(torch.stack(mine).sum().double())


def forward_backward(trainer, step: int, micro: list, valid: int | torch.Tensor) -> torch.Tensor:
    """Forward and backward of the step's micro-batches (gradients summed); returns this rank's summed
    loss (float64, on the device), each micro-batch's normalised by the labels scored in the whole step
    (label_count; none: by 1, its sum being 0); the hooks' terms (MoE balancing losses) join its backward."""
    scale = grad_scale(trainer.rt.dims)
    weight = scale / (valid.clamp(min=1) if isinstance(valid, torch.Tensor) else max(valid, 1))
    local_loss = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for i, batch in enumerate(micro):
        set_gradient_sync(trainer.model, i == len(micro) - 1 or trainer.cfg.memory.grad_sync == "micro_batch")
        watchdog.phase(step, "forward")
        trainer.step_counts.micro_batch(i, len(micro))  # (the training phase's count, block by block: step_progress.py)
        loss_sum = forward_loss_sum(trainer.model, batch, trainer.autocast_dtype)
        total = loss_sum * weight
        for term in trainer.hooks.after_forward(len(micro), scale):
            total = total + term
        watchdog.phase(step, "backward")
        total.backward()
        local_loss += loss_sum.detach()
    return local_loss
