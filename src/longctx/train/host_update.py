"""memory.model_states = host_optimizer on the metrics line: how long the host's AdamW update took
and how much of it the forward waited for (step/host_optimizer.py overlaps the update of step N - 1
with the forward of step N, block by block)."""

from __future__ import annotations

from .hooks import StepHook


class HostUpdateFields(StepHook):
    """`host_step_s`: seconds of the update step N's forward followed (AdamW on the host and the
    copies of the weights to the device); `host_exposed_s`: seconds that forward waited for it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def log_fields(self, step: int, last: bool) -> dict:
        if step == 1:  # no update came before the first forward
            return {}
        return {"host_step_s": round(self.optimizer.host_step_s, 4),
                "host_exposed_s": round(self.optimizer.host_exposed_s, 4)}

    def run_end(self) -> None:
        self.optimizer.finish_update()  # the last step's update lands before the run hands the model back


def host_update_hooks(optimizer) -> list[StepHook]:
    """The hook for an optimizer that updates on the host (none otherwise)."""
    return [HostUpdateFields(optimizer)] if hasattr(optimizer, "host_exposed_s") else []
