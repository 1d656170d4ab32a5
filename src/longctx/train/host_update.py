"""memory.model_states = host_optimizer on the metrics line: how long the host's AdamW update took
and how much of it the forward waited for (step/host_optimizer.py overlaps the update of step N - 1
with the forward of step N, block by block).

The figures are taken while step N runs, after its forwards: by the time its metrics line is
written, step N's own optimizer step has started update N, which resets the optimizer's wait count
(it read 0 on every line) and may finish before the line (its time then stood for update N - 1's)."""

from __future__ import annotations

from .hooks import StepHook


class HostUpdateFields(StepHook):
    """`host_step_s`: seconds of the update step N's forward followed (AdamW on the host and the
    copies of the weights to the device); `host_exposed_s`: seconds that step N's forwards waited for
    it. Neither on the line of a step no update came before (the first step, the first after a resume or a
    rollback)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.updated = False  # an update was started (an optimizer step ran) since the run began
        self.fields: dict = {}  # the current step's figures, once its forwards have run
        self._exposed_before: float | None = None  # the wait count as the step started (None: no update before)
        self._forwards = 0

    def step_start(self, step: int) -> None:
        self.fields, self._forwards = {}, 0
        self._exposed_before = self.optimizer.host_exposed_s if self.updated else None

    def after_forward(self, micro_batches: int, scale: float) -> None:
        self._forwards += 1
        if self._exposed_before is not None and self._forwards == micro_batches:  # every forward has waited
            self.fields = {"host_step_s": round(self.optimizer.host_step_s, 4),
                           "host_exposed_s": round(self.optimizer.host_exposed_s - self._exposed_before, 4)}
        return None

    def after_optimizer(self, step: int, applied) -> None:
        self.updated = True

    def rolled_back(self) -> None:
        self.updated = False  # the reload waited for the update in flight: none comes before the next forward

    def log_fields(self, step: int, last: bool) -> dict:
        return dict(self.fields)

    def run_end(self) -> None:
        self.optimizer.finish_update()  # the last step's update lands before the run hands the model back


def host_update_hooks(optimizer) -> list[StepHook]:
    """The hook for an optimizer that updates on the host (none otherwise)."""
    return [HostUpdateFields(optimizer)] if hasattr(optimizer, "host_exposed_s") else []
