"""checkpoint.on_signal: stop at a step boundary on SIGTERM / SIGUSR1, save, and ask to be requeued.

Slurm sends SIGTERM (or the signal of `--signal=USR1@T`) some time before it kills a job; torchrun
forwards its own SIGTERM to the ranks and gives them 30 s. A rank's handler only records the
signal. After each step every rank tells the others whether it got one, on a gloo group of its
own: a CPU-side all-reduce of one integer, no device-to-host sync (the step's figures stay on the
device). The signal reaches ranks at different moments, so they agree: all stop after the first
step at which any rank had it. Then the trainer saves that step (waiting for any save in flight),
says "saved step N on SIGTERM", and the command exits with REQUEUE_EXIT_CODE.

checkpoint.exit_after_minutes stops the same way at the first step boundary past a deadline on the
rank's own clock (a scheduler's time limit, less the time of a save and a step), counted from the start of
the `longctx train` command (command_clock): a rank past it sends TIME_LIMIT in the same exchange, so the
ranks stop together at the step any of them passed it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import torch

from ..config.rules import parse_signals
from ..errors import REQUEUE_EXIT_CODE
from ..job.launch import ERROR_DIR_ENV

TIME_LIMIT = 1 << 10  # what a rank past the deadline sends (above every signal's number: it wins the MAX)
# when `longctx train` began (time.time()), for the limit: set by command_clock, read by command_age
STARTED_ENV = "LONGCTX_COMMAND_STARTED"


def process_started() -> float:
    """When this process began, as a time.time() reading (Linux's /proc; elsewhere: now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # (field 22: starttime)
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


@contextlib.contextmanager
def command_clock():
    """Around `longctx train`: its start in the environment, where the ranks' set-up finds it (command_age).
    A scheduler's limit counts from the job's start, so the limit must count what ran before the Trainer:
    the interpreter's start, the launcher's preflight (which builds the default store from data.corpus:
    hours for a large corpus) and its ranks' start. A rank that `--nproc N` started keeps its launcher's."""
    old = os.environ.get(STARTED_ENV)
    if old is None or ERROR_DIR_ENV not in os.environ:  # (ERROR_DIR_ENV: a rank our launcher started)
        os.environ[STARTED_ENV] = repr(process_started())
    try:
        yield
    finally:  # (not left to a later run in this process: a library caller's Trainer counts from its own set-up)
        if old is None:
            os.environ.pop(STARTED_ENV, None)
        else:
            os.environ[STARTED_ENV] = old


def command_age() -> float:
    """Seconds since the `longctx train` command this process runs in began (0 outside one: a Trainer
    built by a library caller counts from its own set-up)."""
    try:
        return max(0.0, time.time() - float(os.environ.get(STARTED_ENV, "")))
    except ValueError:  # unset (or not a number)
        return 0.0


class EarlySignals:
    """The signals of checkpoint.on_signal recorded during a run's set-up (the Trainer's __init__, `catch()` to
    `restore()`) and again from the start of `Trainer.run` until the loop's StopOnSignal takes them over
    (`install(early)`). Set-up is minutes at scale (the model, a checkpoint to load, the data): a signal there,
    before the loop caught any, killed the ranks with 128 + its number, so a batch script that requeues on
    REQUEUE_EXIT_CODE did not requeue the preempted run, and the launcher said the run saved nothing on a signal.
    Recorded, it stops the run at the loop's first boundary. The handlers are let go at the end of set-up (a
    Trainer built and never run, or driven by `step()`, leaves no handler that swallows the process's SIGTERM)."""

    def __init__(self, names: str):
        self.received = 0
        self.previous: dict[signal.Signals, object] = {}
        self.signals = parse_signals(names)
        self.catch()

    def catch(self) -> EarlySignals:
        if threading.current_thread() is not threading.main_thread():  # (where handlers can be installed)
            return self
        for s in self.signals:
            if s not in self.previous:
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if not self.received:
            self.received = signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()


def set_up_stop(step: int, name: str) -> str:
    """What a run stopped before its first step says: nothing was trained since the checkpoint it resumed."""
    return (f"{name} came during set-up, before step {step + 1}: nothing was trained since step {step}, whose "
            f"checkpoint it resumed; `--checkpoint.resume auto` continues the run from there (exit code "
            f"{REQUEUE_EXIT_CODE}: a batch script requeues on it, docs/checkpoints.md).")


class StopOnSignal:
    """Records the configured signals between `install()` and `restore()` and answers, once per step,
    whether any rank has had one or passed `deadline` (a reading of `clock`; None: no limit), as
    `agreed()`: the signal's name, or the time limit's, the same on every rank. `limit_minutes` is what
    the deadline came from (said in the name)."""

    def __init__(self, names: str, world: int, group_factory=None, deadline: float | None = None,
                 limit_minutes: float = 0.0, clock=time.monotonic):
        self.signals = parse_signals(names)
        self.world = world
        self.deadline, self.limit_minutes, self.clock = deadline, limit_minutes, clock
        self._group_factory = group_factory  # () -> a gloo group over every rank (created when installed)
        self._group = None
        self._received = 0  # the first signal's number, from the handler
        self._previous: dict[signal.Signals, object] = {}

    def install(self, early: EarlySignals | None = None) -> StopOnSignal:
        """Catch the signals (and take over `early`'s: a signal it recorded during set-up counts, and the
        handlers restored at the end are the ones from before it)."""
        if threading.current_thread() is not threading.main_thread():
            self.signals = []  # (handlers can only be installed from the main thread: tests run there)
        if self.signals or self.deadline is not None:
            if self.world > 1 and self._group_factory is not None:
                self._group = self._group_factory()
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        if early is not None:
            self._received = self._received or early.received
            for s, handler in early.previous.items():
                if s in self._previous:
                    self._previous[s] = handler
                else:
                    signal.signal(s, handler)
            early.previous.clear()
        return self

    def restore(self) -> None:
        """The handlers there were before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if not self._received:
            self._received = signum

    def agreed(self, deadline: bool = True) -> str | None:
        """The signal any rank has received so far (the highest number if several), or None: a
        collective, called by every rank after every step. `deadline=False`: signals only (before any step: a
        limit passed in set-up still trains a step and saves it, where stopping would requeue a job that never
        trains)."""
        if not self.signals and (self.deadline is None or not deadline):
            return None
        got = self._received
        if deadline and self.deadline is not None and self.clock() >= self.deadline:
            got = TIME_LIMIT
        if self.world > 1:
            from ..job import comm  # collectives go through comm

            flag = torch.tensor([got], dtype=torch.int64)
            got = int(comm.all_reduce_in_group(flag, self._group, op=torch.distributed.ReduceOp.MAX)[0])
        if got == TIME_LIMIT:
            return f"the time limit (checkpoint.exit_after_minutes {self.limit_minutes:g})"
        return signal.Signals(got).name if got else None
