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

A count moves inside long work, not only between its pieces (a file's MB read, a prefill's chunks, a long
sequence's layers, a training step's blocks: train/step_progress.py), or the time left would climb while one
runs; a count kept elsewhere (worker processes' shared memory, a phase run inside this one: `Phase.watch_inner`) is
read whenever the phase is said (`Phase.follow`).

A phase that ran that long ends with a line of its time (unless its caller says its own); work that
finishes sooner prints nothing, so short runs read as before. Only rank 0 (env RANK) speaks. The
thread gets its turn while the main thread is in a torch or numpy op or a wait (they release the GIL).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator

from tqdm import tqdm

from .errors import ConfigError

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
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # (refused, also at the command's start: 'abc' was read as 20 s, '-1' and 'nan' as none, 'inf' as never)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{INTERVAL_ENV}={os.environ[INTERVAL_ENV]!r}: it takes the seconds of quiet before a "
                          f"progress line, a number >= 0 ({DEFAULT_INTERVAL_S:g} by default; 0: no such lines). Set "
                          f"it so, or unset it.")
    return value


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

    quiet = False  # (a process that does not speak: its count is read by no line)

    def __init__(self, what: str, total: float | None = None, unit: str = "", bar=None):
        self.what, self.total, self.unit, self.bar = what, total, unit, bar
        self._followed = 0  # (follow: the most its source said; written by the heartbeat's thread alone)
        self.done = 0
        self.started = time.monotonic()
        self.source = None  # (follow: a count kept elsewhere)
        self.work = None    # (weigh: the part of the work a count stands for)
        self.inner = None   # (watch_inner: told of each phase run right inside this one)

    @property
    def done(self) -> float:
        """The count: the working thread's (`update`, or assigned), or what `follow`'s source last said if more.
        Kept apart, each written by one thread: a line that read the count and then wrote it back raised by its
        source put back a count the working thread had set in between (eval's batch made whole, its sequences then
        short at the length's end)."""
        return self._done if self.source is None else max(self._done, self._followed)

    @done.setter
    def done(self, value: float) -> None:
        self._done = value

    def expect(self, total: float | None, unit: str | None = None) -> None:
        """Set (or change) the count the work goes to, and its unit."""
        self.total = total
        if unit is not None:
            self.unit = unit

    def follow(self, source) -> None:
        """Read the count from `source()` whenever the phase is said (work counted where no call reaches
        `update`: worker processes writing to shared memory), never going back."""
        self.source = source

    def weigh(self, work) -> None:
        """Time the rest by `work(done)`, the part (0..1) of the work that `done` stands for, where the count's
        items cost unequal time (a prefill's later chunks attend to more keys): a count's own share would
        promise a time left that each line then pushes back."""
        self.work = work

    def watch_inner(self, inner) -> None:
        """Call `inner(phase)` with each phase run right inside this one from now on (None: no more), as it
        begins: a count that follows a piece of its work counted there (eval's sequences, their prefill's prompt
        tokens). Called under the heartbeat's lock: it must only note the phase."""
        self.inner = inner

    def part(self) -> float:
        """The part (0..1) of the work done, by the count (weighed where `weigh` says); 0 without a total."""
        if not self.total:
            return 0.0
        done = min(self.done, self.total)
        return self.work(done) if self.work is not None else done / self.total

    def update(self, n: float = 1) -> None:
        """`n` more of the total done (called from the working thread; a heartbeat reads it), on
        the bar given too (progress_bar's, or None)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def describe(self, now: float) -> str:
        """'embed [1m20s]: 800/1,716 documents (47%), about 1m30s left'."""
        elapsed = now - self.started
        if self.source is not None:
            self._followed = max(self._followed, self.source())
        text = f"{self.what} [{duration(elapsed)}]"
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            done = min(self.done, self.total)
            counts = f"{_count(done, self.total)}/{_count(self.total, self.total)}"
            text += f": {counts}{unit} ({100 * done / self.total:.0f}%)"
            part = self.part()
            if 0 < done < self.total and part > 0:
                text += f", about {duration(elapsed * (1 - part) / part)} left"
        elif self.done:
            text += f": {self.done:,.0f}{unit} done"
        return text


class LayerCounts:
    """Counts a piece of work in `progress` (a Phase, or None) layer by layer while a model's forward runs it
    through `layers` (its blocks; None: counted when done): each layer's end counts its share, `extra_parts`
    shares kept for what runs after them (an LM head and loss), and `end` makes the count whole, in one
    assignment (a line never sees it go back), moving the phase's bar by the whole piece."""

    def __init__(self, layers, progress: Phase | None, extra_parts: int = 0):
        self.progress, self.base, self.share, self.n = progress, 0.0, 0.0, 0.0
        layers = list(layers or []) if progress is not None else []
        self.parts = len(layers) + extra_parts or 1
        self.handles = [layer.register_forward_hook(self._layer_done) for layer in layers]

    def _layer_done(self, *_) -> None:
        self.progress.done += self.share

    def begin(self, n: float) -> None:
        """A piece of `n` starts (its forward next)."""
        if self.progress is not None:
            self.base, self.share, self.n = self.progress.done, n / self.parts, n

    def end(self) -> None:
        if self.progress is not None:
            self.progress.done = self.base + self.n
            if self.progress.bar is not None:
                self.progress.bar.update(self.n)

    def close(self) -> None:
        """The hooks off the layers (also after an error: call it in a finally)."""
        for handle in self.handles:
            handle.remove()


def _count(n: float, total: float) -> str:
    """A count as a line says it: whole, but a part of one too in a total of few ('0.4/2 sequences' where '0/2'
    would not move, '0.3/0.4 MB'), never '8.0' for a count a hair short of 8 (whole, as the lines around it)."""
    tenths = f"{n:,.1f}"
    return tenths if total < 100 and not tenths.endswith(".0") else f"{n:,.0f}"


class _Quiet(Phase):
    """The phase of a process that does not speak (rank > 0, lines off): counts, says nothing."""

    quiet = True


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
            if len(self.phases) > 1 and self.phases[-2].inner is not None:
                self.phases[-2].inner(phase)
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
