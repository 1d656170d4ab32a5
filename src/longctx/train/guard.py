"""Whether a step's update is applied, decided on the device: train.on_nonfinite and train.spike_factor.

A step is bad when its global loss or gradient norm is not finite, or, with a spike factor, when
its loss exceeds spike_factor x the median of the last spike_window good steps' losses (the check
starts once that window is full: the first steps' losses fall too fast to have a median). The
decision is a 0-d bool tensor on the device, taken by the optimizer step like a gradient scaler's
found-inf (step.guarded_step): no step waits for the device. The window is a small device tensor,
written every step; what the loop does with a bad step (skip, stop, roll back) is read later, with
the step's other figures. The window is training state: checkpoints save it beside the data position
(trainer_state.json) and a resume restores it, so a resumed run checks the steps after the resumed
one as the uninterrupted run did (without it, the check would be off for spike_window steps); a
rollback takes the window of the checkpoint it goes back to, for the same reason.
"""

from __future__ import annotations

import math

import torch

from ..errors import TrainingError


class StepGuard:
    def __init__(self, spike_factor: float, spike_window: int, device: torch.device):
        self.factor, self.window, self.device = float(spike_factor), int(spike_window), device
        self.reset()

    def reset(self) -> None:
        """Forget the losses seen (a new guard, or a checkpoint saved without a window)."""
        self._recent = torch.full((self.window,), float("nan"), dtype=torch.float64, device=self.device)
        self._seen = 0  # steps checked since the reset (host count: no read of the device)

    def state_dict(self) -> dict:
        """The window as JSON: the losses of the last min(steps seen, spike_window) steps, oldest
        first, None for a bad step's empty slot. Read on the host (a save waits for the device anyway)."""
        n = min(self._seen, self.window)
        recent = self._recent.tolist()
        ordered = [recent[i % self.window] for i in range(self._seen - n, self._seen)]
        return {"losses": [None if math.isnan(x) else x for x in ordered]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a window saved by state_dict (None: a checkpoint saved without one; the window
        starts empty, as after reset). Under another train.spike_window the newest losses that fit
        are kept, and the check starts once the window is full again."""
        self.reset()
        losses = [] if state is None else list(state["losses"])[-self.window:]
        values = [float("nan") if x is None else float(x) for x in losses]
        self._recent[:len(values)] = torch.tensor(values, dtype=torch.float64)
        self._seen = len(values)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply the update, is a spike): 0-d bool tensors, the same on every rank (the loss and
        the gradient norm are global)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if not self.factor:
            return finite, torch.zeros((), dtype=torch.bool, device=finite.device)
        loss = loss.detach().to(torch.float64)
        if self._seen >= self.window:  # a bad step's slot holds NaN, which the median ignores
            spike = finite & (loss > self.factor * torch.nanmedian(self._recent))
        else:
            spike = torch.zeros((), dtype=torch.bool, device=finite.device)
        good = finite & ~spike
        self._recent[self._seen % self.window] = torch.where(good, loss, torch.full_like(loss, float("nan")))
        self._seen += 1
        return good, spike


def bad_step_reason(loss: float, grad_norm: float, spike: float, spike_factor: float, spike_window: int) -> str | None:
    """What was wrong with a step, from its figures as read back on the host (None: nothing)."""
    if math.isfinite(loss) and math.isfinite(grad_norm) and not spike:
        return None
    if spike:
        return (f"the training loss {loss:.4g} is a spike (over train.spike_factor = {spike_factor:g} x the "
                f"median of the last {spike_window} steps)")
    return f"the training loss is {loss} (gradient norm {grad_norm})"


def stopped_run_error(what: str, step: int, lr: float) -> TrainingError:
    """The error that ends a run at a bad step under train.on_nonfinite = stop."""
    return TrainingError(
        f"{what} at step {step} (learning rate {lr:.3g}); its update was not "
        f"applied, and the run stops (train.on_nonfinite = stop; losses are read every "
        f"metrics.log_interval steps and before every checkpoint, so no checkpoint holds this step). "
        f"Lower train.lr, raise train.warmup_steps or set train.grad_clip; train.on_nonfinite = skip "
        f"goes on without it, rollback goes back to the last checkpoint and skips the data since.")


def skip_limit_error(in_a_row: int, limit: int, step: int, loss: float, grad_norm: float,
                     first: int | None = None) -> TrainingError:
    """The error that ends a run under train.on_nonfinite = skip once train.skip_limit steps in a row were skipped:
    a run that no longer trains (a learning rate that diverged, broken data) would otherwise go on to train.steps
    and save its untrained weights as if it had trained (DeepSpeed's loss scaler and Megatron's NaN check raise too).
    `first`: the streak's first step as recorded (None: a checkpoint saved before it was, `step - in_a_row + 1`). The
    streak's steps need not be consecutive: a resume from a checkpoint an earlier attempt rolled back to goes on after
    that rollback's window, whose steps it never runs."""
    first = step - in_a_row + 1 if first is None else first
    between = "" if step - first + 1 == in_a_row else ", the steps between not run: a rollback skipped their data"
    steps = f"step {step} was" if in_a_row == 1 else f"steps {first}-{step} ({in_a_row} in a row{between}) were"
    return TrainingError(
        f"{steps} bad and not applied (the last, step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}), and "
        f"train.skip_limit is {limit}: the run stops (train.on_nonfinite = skip). Losses are read every "
        f"metrics.log_interval steps and before every checkpoint, so no checkpoint of step {step} or later was "
        f"saved: the last one saved stays what `--checkpoint.resume auto` reads. Lower train.lr (or raise "
        f"train.warmup_steps, set train.grad_clip), check the data of these steps, raise train.skip_limit (0 = no "
        f"limit), or use train.on_nonfinite = rollback to go back to the last checkpoint and skip the data since.")
