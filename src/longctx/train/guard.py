"""Whether a step's update is applied, decided on the device: train.on_nonfinite and train.spike_factor.

A step is bad when its global loss or gradient norm is not finite, or, with a spike factor, when
its loss exceeds spike_factor x the median of the last spike_window good steps' losses (at an even window the
mean of the two middle ones, as the median is usually defined; the check
starts once that window is full: the first steps' losses fall too fast to have a median). A bad
step's loss never enters the window and pushes no good one out: after a streak of bad steps the check
still compares with the last good ones (it once kept one slot per step, a bad step's empty, so
spike_window bad steps in a row emptied it and switched the check off: the next spike was applied).
The decision is a 0-d bool tensor on the device, taken by the optimizer step like a gradient scaler's
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
        # the last `window` good steps' losses, oldest first, NaN where none yet: it fills from its end
        self._recent = torch.full((self.window,), float("nan"), dtype=torch.float64, device=self.device)

    def state_dict(self) -> dict:
        """The window as JSON: the last min(good steps seen, spike_window) good steps' losses, oldest first.
        Read on the host (a save waits for the device anyway)."""
        return {"losses": [x for x in self._recent.tolist() if not math.isnan(x)]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a window saved by state_dict (None: a checkpoint saved without one; the window
        starts empty, as after reset). Under another train.spike_window the newest losses that fit
        are kept, and the check starts once the window is full again. A window saved with a slot per
        step holds None for a bad step's: left out, as the good steps' window has no place for it."""
        self.reset()
        losses = [] if state is None else [float(x) for x in state["losses"] if x is not None]
        values = losses[len(losses) - min(len(losses), self.window):]
        if values:
            self._recent[self.window - len(values):] = torch.tensor(values, dtype=torch.float64)

    def _median(self) -> torch.Tensor:
        """The window's median, the usual one: at an even spike_window the mean of the two middle losses (not
        torch.nanmedian's lower of them, which made the threshold lower than the documented median x factor and
        called a step below it a spike). On the device, no host read; meaningful once the window is full (before,
        NaNs sort last and the check is off anyway)."""
        ordered = torch.sort(self._recent).values
        return (ordered[(self.window - 1) // 2] + ordered[self.window // 2]) / 2

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply the update, is a spike): 0-d bool tensors, the same on every rank (the loss and
        the gradient norm are global)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if not self.factor:
            return finite, torch.zeros((), dtype=torch.bool, device=finite.device)
        loss = loss.detach().to(torch.float64)
        full = ~torch.isnan(self._recent[0])  # (on the device: which steps were good is not read on the host)
        spike = finite & full & (loss > self.factor * self._median())
        good = finite & ~spike
        # a good step's loss joins the window, its oldest leaves; a bad step leaves it as it was
        self._recent = torch.where(good, torch.cat([self._recent[1:], loss.reshape(1)]), self._recent)
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
