"""What watches the training loop from outside while it runs: the hang watchdog (parallel.timeout_s:
a rank idle that long says where it and its peers were, and the job ends) and the stop on a signal
(checkpoint.on_signal, in a run that can save: stop at a step boundary on SIGTERM / SIGUSR1, or past
checkpoint.exit_after_minutes, preemption.py)."""

from __future__ import annotations

import contextlib
import os
import time

from ..config import Config
from ..job import watchdog
from ..job.launch import ERROR_DIR_ENV, new_gloo_group
from ..job.runtime import Runtime
from .preemption import EarlySignals, StopOnSignal


@contextlib.contextmanager
def watched(cfg: Config, rt: Runtime, can_save: bool, started: float = 0.0, clock=time.monotonic,
            early: EarlySignals | None = None):
    """Both watchers for the block; yields the StopOnSignal that the loop asks after each step (and, with
    checkpoint.exit_after_minutes, at the deadline that many minutes after `started`, a reading of `clock`).
    `early`: the signals recorded during set-up, taken over (preemption.EarlySignals)."""
    minutes = cfg.checkpoint.exit_after_minutes if can_save else 0.0
    stop = StopOnSignal(cfg.checkpoint.on_signal if can_save else "", rt.world, new_gloo_group,
                        deadline=started + 60 * minutes if minutes else None, limit_minutes=minutes, clock=clock)
    watch = (watchdog.Watchdog(cfg.parallel.timeout_s, rt.rank, os.environ.get(ERROR_DIR_ENV))
             if rt.world > 1 else None)
    try:
        if watch is not None:
            watch.start()
        stop.install(early)
        yield stop
    finally:
        if watch is not None:
            watch.stop()
        stop.restore()
        if early is not None:  # (not taken over: the watchdog failed to start)
            early.restore()
