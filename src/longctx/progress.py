"""Progress for long work: bars for a person at a terminal, and heartbeat lines for everyone.

A bar redraws itself with carriage returns; sent to a file or a pipe (a scheduler's log, `| tee`,
torchrun's redirected output) each redraw is one more frame that buries the metrics lines. So a bar
is shown only when it is wanted (metrics.progress, data build --no-progress) and stderr is a
terminal; everything else reads the one line per log interval.

A log must not fall silent either: loading weights, building a data store, evaluating one length or
running one benchmark case can each take minutes before the next line. `phase("embed", total=n,
unit="documents")` marks such work; while any phase runs, a daemon thread writes a line to stderr
whenever nothing was said for LONGCTX_PROGRESS_S seconds (default 20: with start-up and a line's own
delay, no gap in the log exceeds 30 s; 0 turns the lines off), naming the innermost phase inside its
outer ones, how long each has run and, where the caller counts, done/total and the time left:

    ... data build [48s] > embed [21s]: 800/1,716 documents (47%), about 24s left

A phase that ran that long ends with a line of its time (unless its caller says its own); work that
finishes sooner prints nothing, so short runs read as before. Only rank 0 (env RANK) speaks. The
thread gets its turn while the main thread is in a torch or numpy op or a wait (they release the GIL).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from tqdm import tqdm

INTERVAL_ENV = "LONGCTX_PROGRESS_S"
DEFAULT_INTERVAL_S = 20.0


def on_terminal() -> bool:
    """Whether stderr is an interactive terminal (not a file, a pipe or a dumb console)."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True, initial: int = 0):
    """A tqdm bar on stderr, or None when it is not wanted or stderr is not a terminal. `initial`: the count
    already done (a resumed run's steps), which tqdm leaves out of the rate and so of the time left."""
    if not (enabled and on_terminal()):
        return None

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False,
                initial=initial)


# ----------------------------------------------------------------------------------------------
# heartbeat lines


def interval_s() -> float:
    """Seconds of silence before a heartbeat line (LONGCTX_PROGRESS_S; 0: none)."""
    text = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(text) if text else DEFAULT_INTERVAL_S
    except ValueError:
        value = DEFAULT_INTERVAL_S
    return max(value, 0.0)


def duration(seconds: float) -> str:
    """'45s', '3m05s', '1h02m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Phase:
    """One piece of long work: what it is, since when, and (when the caller counts) done of total."""

    def __init__(self, what: str, total: float | None = None, unit: str = "", bar=None):
        self.what, self.total, self.unit, self.bar = what, total, unit, bar
        self.done = 0
        self.started = time.monotonic()

    def expect(self, total: float | None, unit: str | None = None) -> None:
        """Set (or change) the count the work goes to, and its unit."""
        self.total = total
        if unit is not None:
            self.unit = unit

    def update(self, n: float = 1) -> None:
        """`n` more of the total done (called from the working thread; a heartbeat reads it), on
        the bar given too (progress_bar's, or None)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def describe(self, now: float) -> str:
        """'embed [1m20s]: 800/1,716 documents (47%), about 1m30s left'."""
        elapsed = now - self.started
        text = f"{self.what} [{duration(elapsed)}]"
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            done = min(self.done, self.total)
            text += f": {done:,.0f}/{self.total:,.0f}{unit} ({100 * done / self.total:.0f}%)"
            if 0 < done < self.total:
                text += f", about {duration(elapsed * (self.total - done) / done)} left"
        elif self.done:
            text += f": {self.done:,.0f}{unit} done"
        return text


class _Quiet(Phase):
    """The phase of a process that does not speak (rank > 0, lines off): counts, says nothing."""


class _Heartbeat:
    """The phases running in this process, and the thread that speaks for them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phases: list[Phase] = []
        self.last = 0.0         # when the last line was written, or the first phase began
        self.interval = DEFAULT_INTERVAL_S
        self.stop: threading.Event | None = None  # the running thread's, set to end it

    def enter(self, phase: Phase, interval: float) -> None:
        with self.lock:
            self.phases.append(phase)
            if self.stop is None:  # the first phase: the quiet begins now
                self.interval, self.last = interval, phase.started
                self.stop = threading.Event()
                threading.Thread(target=self._run, args=(self.stop,), name="longctx-progress", daemon=True).start()

    def leave(self, phase: Phase, line: str | None) -> None:
        with self.lock:
            if phase in self.phases:
                self.phases.remove(phase)
            if line is not None:
                _write(line)
                self.last = time.monotonic()
            if not self.phases and self.stop is not None:
                self.stop.set()
                self.stop = None

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                if stop.is_set() or not self.phases:
                    return
                now = time.monotonic()
                due = self.last + self.interval
                if now >= due:
                    _write("... " + " > ".join(p.describe(now) for p in self.phases))
                    self.last, due = now, now + self.interval
            stop.wait(min(1.0, max(due - time.monotonic(), 0.01)))


_HEARTBEAT = _Heartbeat()
# a child forked while a phase ran (its lock perhaps held by the thread, which the child lacks) starts afresh
os.register_at_fork(after_in_child=_HEARTBEAT.__init__)


def _write(line: str) -> None:
    try:
        if on_terminal():  # above any bar drawn there, which is redrawn under it
            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed under us (the process is ending): say nothing
        pass


def speaks() -> bool:
    """Whether this process writes heartbeat lines: rank 0 (or no RANK), and lines not turned off."""
    return os.environ.get("RANK", "0") in ("", "0") and interval_s() > 0


@contextlib.contextmanager
def phase(what: str, total: float | None = None, unit: str = "", done_line: bool = True,
          bar=None) -> Iterator[Phase]:
    """Mark `what` as running: a heartbeat line whenever the log was quiet for interval_s() while it
    (or a phase inside it) runs, and, when it ran that long and `done_line`, a closing line with its
    time (pass False where the caller says its own). Count with the Phase it yields (`update`),
    which also moves `bar` (a progress_bar, or None)."""
    interval = interval_s()
    if not speaks():
        yield _Quiet(what, total, unit, bar)
        return
    p = Phase(what, total, unit, bar)
    _HEARTBEAT.enter(p, interval)
    line = None
    try:
        yield p
        took = time.monotonic() - p.started
        if done_line and took >= interval:
            line = f"... {p.what}: done in {duration(took)}"
    finally:
        _HEARTBEAT.leave(p, line)


def say(line: str) -> None:
    """A command's own progress or status line, on stderr (stdout keeps what the command prints:
    JSON, text), flushed, above any bar drawn; the quiet a heartbeat waits for starts again. The one
    way the commands speak (`speaker` for a prefixed one)."""
    _write(line)
    said()


def speaker(prefix: str = "", clock: bool = False):
    """`say` with `prefix` before each line (and, with `clock`, the seconds since this call)."""
    start = time.perf_counter()

    def speak(line: str) -> None:
        elapsed = f"[{time.perf_counter() - start:7.1f} s] " if clock else ""
        say(f"{prefix}{elapsed}{line}")
    return speak


def said() -> None:
    """Note that a line was just written (a log line of the caller's own): the quiet that a
    heartbeat waits for starts again, so a loop that logs often gets no heartbeat lines between."""
    with _HEARTBEAT.lock:
        if _HEARTBEAT.phases:
            _HEARTBEAT.last = time.monotonic()


def current() -> Phase:
    """The innermost running phase (to count in code that a phase's caller does not reach), or a
    quiet one that goes nowhere."""
    with _HEARTBEAT.lock:
        return _HEARTBEAT.phases[-1] if _HEARTBEAT.phases else _Quiet("")
