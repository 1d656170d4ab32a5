"""The hang watchdog: parallel.timeout_s enforced on every rank, and where each rank was when it fired.

A rank whose main thread has waited inside torch.distributed (a collective, any group, FSDP's
included; or the wait of a transfer comm.py started, as the ring's: not its own work there, as
a checkpoint's reads or DTensor's local dispatch, _LOCAL_WORK) or in a checkpoint save for
parallel.timeout_s without progress is waiting for a peer that is hung. A rank that merely computes
for long (a first torch.compile, a long forward) waits for nobody, and nothing fires. Progress is a
new phase of the training loop (`phase(step, name)`: data, forward, backward, optimizer, save,
load, eval), a collective issued through comm.py (`tick()`: one attribute write, no I/O; a save's
hashing ticks too) or, in a save, its own files growing (`watch_writes`). A
daemon thread per rank looks once a second at where the main thread is. When it fires it:
- dumps every thread's Python stack (faulthandler: it reads frames without running them);
- records where the rank was: step, phase, and what the main thread waits in (or that it waits in
  nothing: it is the one stuck);
- gives its peers `grace_s` to do the same, then ends the process with HANG_EXIT_CODE (a rank
  blocked in a collective cannot unwind).

Under `longctx train --nproc N` the records, the stacks and a heartbeat written each second go to
the launcher's error folder. A rank that sees a peer's record there records itself too, wherever
it is, so that the hung rank's own stack shows where it is stuck. The launcher prints one summary
naming the hung rank(s), then every rank's stack (`hang_report`). A rank the watchdog could not
run on (frozen by SIGSTOP, stuck in C code holding the GIL) leaves no record; its heartbeat says
where it stopped. Under another launcher each rank that fires prints its record and stack to stderr.

The process groups' own timeouts are set above timeout_s (`backend_timeout_s`), a backstop, so that
the watchdog, which can say where everyone was, speaks first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 86  # a rank ended by the watchdog (nothing else in longctx exits with it)
PHASES = ("setup", "data", "forward", "backward", "optimizer", "save", "load", "eval")
_ACTIVE: Watchdog | None = None


def backend_timeout_s(timeout_s: float) -> float:
    """What the process groups themselves wait: past the watchdog's firing and its grace."""
    return timeout_s + grace_s(timeout_s) + 30.0


_GROUP_TIMEOUT_S: float | None = None  # what process groups created after init_distributed wait


def set_group_timeout(timeout_s: float) -> None:
    global _GROUP_TIMEOUT_S
    _GROUP_TIMEOUT_S = backend_timeout_s(timeout_s)


def group_timeout():
    """The timeout to give a process group created now (None: torch's default, before a job set it)."""
    from datetime import timedelta

    return None if _GROUP_TIMEOUT_S is None else timedelta(seconds=_GROUP_TIMEOUT_S)


def grace_s(timeout_s: float) -> float:
    return min(10.0, max(2.0, timeout_s / 6))


def running() -> bool:
    """Whether a watchdog watches this rank now (the training loop's; none in set-up)."""
    return _ACTIVE is not None


def tick() -> None:
    """Progress (a collective issued or finished); free when no watchdog runs."""
    if _ACTIVE is not None:
        _ACTIVE.last = time.monotonic()


_WRITTEN = None  # () -> int: this rank's bytes of the checkpoint being written (watch_writes), or None


def watch_writes(written) -> None:
    """A save's progress while it writes (`written()`: this rank's bytes of it so far; None when no save is in
    flight): in the save phase a rank that waits for its own writes is not hung while they grow. A save of a
    large model to a slow disk (the last step's, waited for at the end of the run) took longer than
    parallel.timeout_s and the watchdog ended the rank, the checkpoint lost."""
    global _WRITTEN
    _WRITTEN = written


def phase(step: int, name: str) -> None:
    """The rank enters `name` of `step` (0 before the first step)."""
    w = _ACTIVE
    if w is not None:
        w.step, w.phase, w.last = step, name, time.monotonic()


@contextlib.contextmanager
def in_phase(step: int, name: str):
    """`name` of `step` for the block, then the phase it began in again. A save's phase counts as waiting (a save
    stuck in I/O waits in no collective); left on after the save returned, it counted the rest of the step and the
    next one's stage entry, the rank computing, as a save that made no progress: exit 86 after a committed save."""
    w = _ACTIVE
    before = None if w is None else (w.step, w.phase)
    phase(step, name)
    try:
        yield
    finally:
        if before is not None and _ACTIVE is w:
            phase(*before)


class Watchdog:
    """One per rank, between `start()` and `stop()`. `folder`: where records go (the launcher's
    error folder), or None to print them."""

    def __init__(self, timeout_s: float, rank: int, folder: str | os.PathLike | None = None,
                 exit_process: bool = True):
        self.timeout_s, self.rank = float(timeout_s), rank
        self.folder = Path(folder) if folder else None
        self.exit_process = exit_process  # (False in tests of the record itself)
        self.step, self.phase, self.last = 0, "setup", time.monotonic()
        self._written, self._written_next = 0, 0.0  # (the save's bytes at the last look, and when to look again)
        self._read, self._read_next = -(1 << 62), 0.0  # (the process's bytes read at the last look: a load's)
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="longctx-watchdog", daemon=True)
        self._main = threading.main_thread().ident

    def start(self) -> Watchdog:
        global _ACTIVE
        _ACTIVE = self
        self.last = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        every = min(1.0, self.timeout_s / 10)
        waiting_since, seen = None, self.last
        while not self._stop.wait(every):
            now = time.monotonic()
            place = main_thread_place(self._main)
            if place["collective"] or self.phase == "save" or place.get("io"):
                if waiting_since is None or self.last != seen:  # (a wait began at most one look ago)
                    waiting_since = max(self.last, now - every)
                elif (self.phase == "save" and self._written_more(now)) or (place.get("io") and self._read_more(now)):
                    waiting_since = now  # (its own writes or reads grew: a slow disk, not a hung peer)
            else:
                waiting_since = None
            seen = self.last
            self._beat(now - self.last)
            if waiting_since is not None and now - waiting_since >= self.timeout_s:
                self._fire(now - waiting_since, place)
                return
            if self.folder is not None and any(f.stem != f"hang{self.rank}" for f in self.folder.glob("hang*.json")):
                self._fire(now - self.last, place)  # a peer gave up waiting: say where this rank is
                return

    def _written_more(self, now: float) -> bool:
        """Whether the save's bytes (watch_writes) changed since the last look, looked at every tenth of the timeout
        at most (a stat of this rank's files: cheap, but on a shared file system not once a second per rank)."""
        if _WRITTEN is None or now < self._written_next:
            return False
        self._written_next = now + self.timeout_s / 10
        try:
            written = _WRITTEN()
        except OSError:  # (the directory renamed into place or removed between two looks)
            return False
        grew, self._written = written != self._written, written
        return grew

    def _read_more(self, now: float) -> bool:
        """Whether this process's bytes read (/proc/self/io rchar) grew since the last look by more than the looks'
        own reads of that file (~100 B each), looked at every tenth of the timeout at most; True where they cannot
        be read (another OS: a read is then not timed)."""
        if now < self._read_next:
            return False
        self._read_next = now + self.timeout_s / 10
        try:
            with open("/proc/self/io") as f:
                read = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
        except (OSError, ValueError, StopIteration):
            return True
        grew, self._read = read - self._read > _OWN_READ_BYTES, read
        return grew

    def _beat(self, idle: float) -> None:
        if self.folder is not None:
            _write_json(self.folder / f"beat{self.rank}.json",
                        {"rank": self.rank, "pid": os.getpid(), "step": self.step, "phase": self.phase,
                         "idle_s": round(idle, 1), "time": time.time()})

    def _record(self, record: dict) -> bool:
        """The stacks and the record in the launcher's folder; False when it takes no file (a full or
        read-only /tmp, an inode quota, the folder gone): an OSError here ended the watchdog's thread
        before the process, and the hang went on to the process groups' backstop, unexplained."""
        try:
            with open(self.folder / f"stack{self.rank}.txt", "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            return _write_json(self.folder / f"hang{self.rank}.json", record)
        except OSError:
            return False

    def _fire(self, idle: float, place: dict) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "phase": self.phase,
                  "idle_s": round(idle, 1), "time": time.time(), **place}
        if self.folder is None or not self._record(record):  # (no launcher's folder, or one that takes no file)
            print(f"[rank {self.rank}] longctx: waited {idle:.0f} s without progress (parallel.timeout_s = "
                  f"{self.timeout_s:g}): {describe(record)}. Python stacks:", file=sys.stderr, flush=True)
            # (a stderr with no file descriptor, as a program that replaced sys.stderr has: no stacks; the rank ends)
            with contextlib.suppress(OSError, ValueError):
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.fired.set()
        if self.exit_process:
            time.sleep(grace_s(self.timeout_s))  # the peers record where they were too
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)


# Modules of torch.distributed whose work is this rank's own, not a wait for a peer: a checkpoint's storage
# reads and writes and its local planning and staging, DTensor's dispatch and sharding propagation of a local op
# (an optimizer step over sharded parameters). Where the innermost torch.distributed frame is one of these, the rank
# computes or does I/O (a slow disk reading a large checkpoint back is not a hung peer); a wait in a collective has a
# communication module innermost (distributed_c10d, functional collectives, FSDP's collectives).
# Storage reads and writes among them are timed as a save is: waiting, unless this process's bytes read grow (a
# read that stalls on every rank, a shared file system gone during a rollback's load, is a hang no collective's
# timeout ends).
_LOCAL_IO = ("checkpoint/filesystem.py", "checkpoint/_fsspec_filesystem.py", "checkpoint/hf_storage.py")
_OWN_READ_BYTES = 4096  # (what the watchdog's own reads of /proc/self/io add to rchar between two looks, at most)
_LOCAL_WORK = (*_LOCAL_IO, "checkpoint/staging.py", "checkpoint/_state_dict_stager.py", "checkpoint/default_planner.py",
               "checkpoint/planner_helpers.py", "checkpoint/_dedup_save_plans.py", "checkpoint/_traverse.py",
               "tensor/_dispatch.py", "tensor/_sharding_prop.py", "tensor/_op_schema.py", "tensor/_ops/")


def main_thread_place(main_ident: int | None) -> dict:
    """Whether the main thread waits inside torch.distributed (and in what), and its innermost frame
    of our code (longctx's, or the program's: not a library's or Python's)."""
    frame = sys._current_frames().get(main_ident)
    collective = where = io = None
    decided = False  # (by the innermost torch.distributed frame: the ones around it called it)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        # comm.py's handles of transfers in flight (the ring's Pending, PendingTransfer) wait in the
        # C++ Work.wait(), which has no Python frame of torch.distributed: their `wait` is the wait
        if not decided and ("/torch/distributed/" in path or (
                path.endswith("/longctx/job/comm.py") and frame.f_code.co_name == "wait")):
            decided = True
            module = path.split("/torch/distributed/", 1)[-1]
            label = f"{frame.f_code.co_name} ({path.rsplit('/', 1)[-1]})"
            if not module.startswith(_LOCAL_WORK):
                collective = label
            elif module.startswith(_LOCAL_IO):
                io = label
        if where is None and ("/longctx/" in path or not ("-packages/" in path or "/lib/python" in path
                                                          or "/torch/" in path or path.startswith("<"))):
            short = path.split("/longctx/", 1)[1] if "/longctx/" in path else path.rsplit("/", 1)[-1]
            where = f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return {"collective": collective, "where": where, **({"io": io} if io else {})}


def describe(record: dict) -> str:
    place = (f"waiting in a collective, {record['collective']}" if record.get("collective")
             else f"in a checkpoint's I/O, {record['io']}, reading nothing" if record.get("io")
             else "not in a collective")
    at = f" at {record['where']}" if record.get("where") else ""
    return f"step {record['step']}, {record['phase']}, {place}{at}"


def hang_report(folder: Path, nproc: int) -> tuple[str, str] | None:
    """After a failed job: (summary, stacks) when a watchdog fired, else None. The hung ranks are
    those that were not waiting in a collective (stuck in their own code, or in a save's I/O), and
    those that left no record (frozen or killed) while their peers waited."""
    records = _by_rank(folder, "hang")
    if not records:
        return None
    beats = _by_rank(folder, "beat")
    fired_at = min(r["time"] for r in records.values())
    waited = [r["idle_s"] for r in records.values() if r.get("collective")]
    timeout = max(waited or [r["idle_s"] for r in records.values()])
    lines, hung = [], []
    for rank in range(nproc):
        r = records.get(rank)
        if r is not None:
            lines.append(f"  rank {rank}: {describe(r)}, idle {r['idle_s']:.0f} s")
            if not r.get("collective"):
                hung.append(rank)
            continue
        beat = beats.get(rank)
        if beat is None:
            lines.append(f"  rank {rank}: no heartbeat at all (it never started, or died first)")
            hung.append(rank)
        elif fired_at - beat["time"] > 3.0:
            lines.append(f"  rank {rank}: its heartbeat (written once a second) stopped "
                         f"{fired_at - beat['time']:.0f} s before the others gave up, last at step {beat['step']}, "
                         f"{beat['phase']}: frozen "
                         f"(SIGSTOP), or stuck where Python cannot run")
            hung.append(rank)
        else:
            lines.append(f"  rank {rank}: step {beat['step']}, {beat['phase']}; it stopped when a peer did")
    if hung:
        who = ", ".join(map(str, hung))
        own = records.get(hung[0])
        peer = next((r for r in records.values() if r.get("collective")), None)
        head = (f"rank{'s' if len(hung) > 1 else ''} {who} of {nproc} hung"
                + (f" at step {own['step']} ({own['phase']})" if own else
                   f" while the others waited at step {peer['step']} ({peer['phase']})" if peer else "")
                + f": no progress for {timeout:.0f} s (parallel.timeout_s), while the other ranks waited for "
                  f"{'them' if len(hung) > 1 else 'it'} in a collective.")
    else:
        head = (f"every rank waited in a collective for {timeout:.0f} s (parallel.timeout_s): they issued "
                f"different collectives or in a different order (a bug: please report it with the stacks).")
    stacks = []
    for rank in sorted(records, key=lambda r: (r not in hung, r)):
        try:
            text = _without_watchdog((folder / f"stack{rank}.txt").read_text())
        except OSError:
            continue
        stacks.append(f"--- rank {rank} ({'hung' if rank in hung else 'waiting'}) ---\n{text}")
    summary = (head + " Where each rank was:\n" + "\n".join(lines)
               + "\nThe job was stopped; no rank is left running. Their Python stacks are printed above. "
                 "A rank stuck in I/O or a dead link hangs like this; raise parallel.timeout_s if a phase "
                 "legitimately takes longer. `--checkpoint.resume auto` continues the run from its last checkpoint "
                 "(the steps after it train again).")
    return summary, "\n".join(stacks)


def _by_rank(folder: Path, kind: str) -> dict[int, dict]:
    """{rank: record} of the files <kind><rank>.json (one being written is skipped)."""
    out = {}
    for f in folder.glob(f"{kind}*.json"):
        try:
            out[int(f.stem[len(kind):])] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def _without_watchdog(dump: str) -> str:
    """A faulthandler dump without the dumping thread's own block (the watchdog's: it says nothing)."""
    blocks = dump.strip().split("\n\n")
    return "\n\n".join(b for b in blocks if not b.startswith("Current thread")).rstrip()


def _write_json(path: Path, data: dict) -> bool:
    """Whether `path` now holds `data` (written whole, then renamed: a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        return False
    return True
