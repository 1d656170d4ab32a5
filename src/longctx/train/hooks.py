"""Step hooks: what the Trainer calls at fixed points of a step and of the run, so that a concern
such as the MoE routers' bookkeeping (moe_hooks.py) sits beside the loop, not inside it.

In the manner of torchtitan's optimizer hooks: the Trainer holds a short list (`StepHooks`) and
calls every hook at each point, in the list's order; a hook overrides the points it needs, the
others do nothing. A dense run installs none. The points, in the order a step meets them:

- `step_start(step)`: before the step's first micro-batch (its batches already on the device);
- `after_forward(micro_batches, scale)`: after each micro-batch's forward, before its backward,
  inside the Trainer's `device_section` (so: no host reads); returns a loss term the backward
  includes, or None. The Trainer's own term is the summed loss x scale / valid labels; a term that
  is a mean over the step's micro-batches is its value x scale / micro_batches (`scale`:
  parallel/parallelize.py grad_scale, FSDP's averaging undone);
- `after_optimizer(step, applied)`: after the optimizer step and zero_grad; `applied` is the guard's
  0-d bool on the device (guard.py: False when the update was not applied);
- `log_fields(step, last)`: fields for `step`'s metrics line, after the Trainer's own (`last`: the
  run's last step); may run collectives, since every rank writes the line;
- `eval_note()`: a few words for an evaluation's line, or None;
- `rolled_back()`: a rollback discarded the steps run since its checkpoint: they run again;
- `run_end()`: the loop is over, normally or on an error: release what the hook holds.
"""

from __future__ import annotations

import torch


class StepHook:
    """One hook: every point a no-op; a hook overrides the ones it needs (the module docstring says when each runs)."""

    def step_start(self, step: int) -> None:
        pass

    def after_forward(self, micro_batches: int, scale: float) -> torch.Tensor | None:
        return None

    def after_optimizer(self, step: int, applied: torch.Tensor) -> None:
        pass

    def log_fields(self, step: int, last: bool) -> dict:
        return {}

    def eval_note(self) -> str | None:
        return None

    def rolled_back(self) -> None:
        pass

    def run_end(self) -> None:
        pass


class StepHooks:
    """The hooks of a run, called in order at each point."""

    def __init__(self, hooks: list[StepHook] = ()):
        self.hooks = list(hooks)

    def find(self, kind: type) -> StepHook | None:
        """The first hook of type `kind`, or None."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def step_start(self, step: int) -> None:
        for hook in self.hooks:
            hook.step_start(step)

    def after_forward(self, micro_batches: int, scale: float) -> list[torch.Tensor]:
        """Every hook's loss term for this micro-batch's backward (those that have one)."""
        terms = (hook.after_forward(micro_batches, scale) for hook in self.hooks)
        return [t for t in terms if t is not None]

    def after_optimizer(self, step: int, applied: torch.Tensor) -> None:
        for hook in self.hooks:
            hook.after_optimizer(step, applied)

    def log_fields(self, step: int, last: bool) -> dict:
        fields: dict = {}
        for hook in self.hooks:
            fields.update(hook.log_fields(step, last))
        return fields

    def eval_note(self) -> str | None:
        notes = [n for n in (hook.eval_note() for hook in self.hooks) if n]
        return "; ".join(notes) if notes else None

    def rolled_back(self) -> None:
        for hook in self.hooks:
            hook.rolled_back()

    def run_end(self) -> None:
        for hook in self.hooks:
            hook.run_end()
