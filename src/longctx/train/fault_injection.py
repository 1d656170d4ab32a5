"""LONGCTX_FAULT's step faults (faults.py: nonfinite@STEP, spike@STEP, hang@RANK:STEP) as a wrapper
around the Trainer's step, so that the real step holds no fault code.

A testing aid that makes the guards of a long run show they work. For a step some fault plans, the
wrapper puts hooks on the model for that one call of the step:
- nonfinite / spike: a forward hook, run after every other, multiplies the loss the model returns
  by NaN / faults.SPIKE_MULTIPLIER, in every micro-batch of the step; its gradients follow;
- hang: a forward pre-hook, run before every other (before FSDP's all-gather, so the other ranks
  wait in a collective), stops the rank in its forward: faults.hang_forever.
Each fault fires once per process: after a step completes its faults are forgotten, so a step run
again after a rollback is not hit again. Without LONGCTX_FAULT the step is not wrapped at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..faults import SPIKE_MULTIPLIER, hang_forever, planned

STEP_FAULTS = ("nonfinite", "spike", "hang")


def with_step_faults(step: Callable, model: torch.nn.Module, rank: int, world: int | None = None) -> Callable:
    """`step` (a function of the 1-based step number) itself when LONGCTX_FAULT plans no step fault
    on this rank, else `step` wrapped to inject them (FaultyStep)."""
    plans = {kind: planned(kind, rank, world) for kind in STEP_FAULTS}
    return FaultyStep(step, model, plans) if any(plans.values()) else step


class FaultyStep:
    """A step function that injects the faults `plans` ({kind: steps}) names, each once."""

    def __init__(self, step: Callable, model: torch.nn.Module, plans: dict[str, set[int]]):
        self.step, self.model, self.plans = step, model, plans

    def __call__(self, step: int):
        handles = self._install(step)
        try:
            out = self.step(step)
        finally:
            for handle in handles:
                handle.remove()
        for steps in self.plans.values():
            steps.discard(step)
        return out

    def _install(self, step: int) -> list:
        """The model hooks of `step`'s faults (their handles)."""
        handles = []
        if step in self.plans["hang"]:
            handles.append(self.model.register_forward_pre_hook(lambda *_: hang_forever(), prepend=True))
        nonfinite, spike = step in self.plans["nonfinite"], step in self.plans["spike"]
        if nonfinite or spike:
            def corrupt(_module, _args, loss):
                if nonfinite:
                    loss = loss * float("nan")
                if spike:
                    loss = loss * SPIKE_MULTIPLIER
                return loss

            handles.append(self.model.register_forward_hook(corrupt))
        return handles
