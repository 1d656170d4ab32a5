"""checkpoint.on_signal: stop at a step boundary on SIGTERM / SIGUSR1, save, and ask to be requeued.

Slurm sends SIGTERM (or the signal of `--signal=USR1@T`) some time before it kills a job; torchrun
forwards its own SIGTERM to the ranks and gives them 30 s. A rank's handler only records the
signal. After each step every rank tells the others whether it got one, on a gloo group of its
own: a CPU-side all-reduce of one integer, no device-to-host sync (the step's figures stay on the
device). The signal reaches ranks at different moments, so they agree: all stop after the first
step at which any rank had it. Then the trainer saves that step (waiting for any save in flight),
says "saved step N on SIGTERM", and the command exits with REQUEUE_EXIT_CODE.
"""

from __future__ import annotations

import signal
import threading

import torch

from ..config.rules import parse_signals


class StopOnSignal:
    """Records the configured signals between `install()` and `restore()` and answers, once per step,
    whether any rank has had one (`agreed()`: the signal's name, the same on every rank)."""

    def __init__(self, names: str, world: int, group_factory=None):
        self.signals = parse_signals(names)
        self.world = world
        self._group_factory = group_factory  # () -> a gloo group over every rank (created when installed)
        self._group = None
        self._received = 0  # the first signal's number, from the handler
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> StopOnSignal:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            self.signals = []  # (handlers can only be installed from the main thread: tests run there)
            return self
        if self.world > 1 and self._group_factory is not None:
            self._group = self._group_factory()
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        """The handlers there were before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if not self._received:
            self._received = signum

    def agreed(self) -> str | None:
        """The signal any rank has received so far (the highest number if several), or None: a
        collective, called by every rank after every step."""
        if not self.signals:
            return None
        got = self._received
        if self.world > 1:
            from ..job import comm  # collectives go through comm

            flag = torch.tensor([got], dtype=torch.int64)
            got = int(comm.all_reduce_in_group(flag, self._group, op=torch.distributed.ReduceOp.MAX)[0])
        return signal.Signals(got).name if got else None
