"""Relaunching a command on N local ranks (`--nproc N`) through torchrun, and what the launcher says
when the job ends badly: each rank hands its error over (a file per rank), and the launcher prints each
distinct message once with the ranks that hit it, a watchdog's hang report, a preemption once (exit 75),
or, when no rank reported, the rank that failed first and how (a rank stopped by a signal sent to it alone, not
its peers that lost it: lost_peer.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from .. import threads
from ..errors import REQUEUE_EXIT_CODE, Preempted, UserError
from . import watchdog
from .launch import ERROR_DIR_ENV
from .lost_peer import outside_stop_message, stop_signal, stopped_from_outside, torchrun_signals


def _write_for_launcher(name: str, text: str) -> bool:
    """This rank's file `name` (its rank in the {}) written with `text` in the folder `longctx train --nproc N`'s
    launcher reads; False where this process was not started that way, or the write failed."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    try:
        (Path(folder) / name.format(rank)).write_text(text)
    except OSError:
        return False
    return True


def hand_error_to_launcher(message: str, exit_code: int) -> bool:
    """Under `longctx train --nproc N`, a rank's error goes to the launcher, which prints each distinct
    message once, naming the ranks that hit it, instead of N copies glued into each other's lines.
    Returns False (print it yourself) when not started that way."""
    return _write_for_launcher("rank{}.json", json.dumps({"message": message, "exit_code": exit_code}))


def another_rank_reported() -> bool:
    """Whether, under `longctx train --nproc N`, a rank other than this one has handed over an error (or noted
    its crash, note_crash): a failure here is then its consequence (a peer gone mid-collective), not news. The
    failing rank writes its report before it exits, so before its peers can see the connection close."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    mine = {f"rank{rank}.json", f"crash{rank}.json"}
    return any(f.name not in mine for pattern in ("rank*.json", "crash*.json") for f in Path(folder).glob(pattern))


def note_crash() -> None:
    """Under `longctx train --nproc N`, when this rank fails with an error of its own that is no UserError (a
    traceback, which it prints itself): the moment, for the launcher to name the rank that failed first. torchrun
    times its ranks' exits to the second, in one pass, so a peer whose collective lost this rank, failing a few
    milliseconds after it, was as early, and the lower rank was named (_first_failure)."""
    _write_for_launcher("crash{}.json", json.dumps({"time": time.time()}))


def note_lost_peer(error: BaseException) -> bool:
    """Under `longctx train --nproc N`, when this rank failed because its process group lost a peer
    (lost_peer.lost_a_peer): the moment and the error's line, for the launcher, which names the rank that went away
    (_first_failure), not this echo of its loss. False where this process was not started that way."""
    line = " ".join(f"{type(error).__name__}: {error}".split())
    return _write_for_launcher("lostpeer{}.json", json.dumps({"time": time.time(), "error": line}))


def note_finished() -> None:
    """Under `longctx train --nproc N`, once this rank's run has ended well (its steps trained, its saves committed):
    a signal that reaches the launcher after every rank did is no stop (_relaunch), though torchrun's agent raises
    on it whatever its ranks then do."""
    _write_for_launcher("finished{}", "")


def _all_finished(folder: Path, nproc: int) -> bool:
    return all((folder / f"finished{rank}").exists() for rank in range(nproc))


def _noted_times(folder: Path, kind: str = "crash") -> dict[int, float]:
    """{rank: when it noted its crash} (note_crash; kind "lostpeer": its lost peer, note_lost_peer)."""
    found = {}
    for f in folder.glob(f"{kind}*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found[int(f.stem[len(kind):])] = float(json.loads(f.read_text())["time"])
    return found


def _rank_errors(folder: Path) -> dict[str, tuple[list[int], int]]:
    """{message: (ranks, exit code)} of the errors the ranks handed over."""
    found: dict[str, tuple[list[int], int]] = {}
    for f in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        try:
            e = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        ranks, _ = found.setdefault(e["message"], ([], int(e["exit_code"])))
        ranks.append(int(f.stem[4:]))
    return found


class RankError(UserError):
    """The errors ranks reported, each once; exits with the first one's code (or the signal's that stopped the job)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def argv_without_nproc(argv: list[str]) -> list[str]:
    """The command line each rank runs: the same, less --nproc (the launcher's own option)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def relaunch(nproc: int, argv: list[str], monitor_interval: float = 0.5, forward=(), kept: str = "") -> None:
    """Run `python -m longctx <argv>` on `nproc` local processes through torchrun; raise on failure.
    `forward`: signals the ranks act on (checkpoint.on_signal), which the launcher passes on to them (_forwarding);
    `kept`: what the command keeps of a run stopped part-way, and where (eval: its finished lengths' file), which
    the launcher's message for a rank stopped from outside repeats."""
    with tempfile.TemporaryDirectory(prefix="longctx-errors-") as folder, _forwarding(forward, folder) as forwarded:
        old = os.environ.get(ERROR_DIR_ENV)
        os.environ[ERROR_DIR_ENV] = folder
        try:
            _relaunch(nproc, argv, monitor_interval, Path(folder), forwarded, kept)
        finally:
            if old is None:
                os.environ.pop(ERROR_DIR_ENV, None)
            else:
                os.environ[ERROR_DIR_ENV] = old


_TORCHRUN_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}  # (torchrun's agent's own)
# never caught in the launcher, whatever checkpoint.on_signal names: the launcher's own children ending, a terminal's
# resize or job control, and the faults of its own code (a handler there would forward them, or stop the job)
_KEPT = {getattr(signal, n) for n in ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGTSTP", "SIGTTIN", "SIGTTOU",
                                      "SIGPIPE", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP")
         if hasattr(signal, n)}


class _Forwarded:
    """What _forwarding shares with the launch: the signals passed on, and whether torchrun's run is under way."""

    def __init__(self):
        self.passed: list[int] = []
        self.running = False


@contextlib.contextmanager
def _forwarding(forward, error_dir: str):
    """The launcher passes SIGUSR1, SIGUSR2 (a scheduler's warnings: Slurm's `--signal=USR1@T`) and the other
    signals of `forward` on to its ranks and goes on waiting for them: they save and exit 75 (or, not acting on
    it, end by it), with no 30 s limit (torchrun's agent stops its ranks that long after its own signals,
    SIGTERM's). torchrun catches only those four: any other signal's default action ended the launcher at once,
    and its ranks with it (SIGKILL on their parent's death) before they could save, even when Slurm signalled
    the ranks too: exit -10, not a word, the steps since the last checkpoint lost. Yields a _Forwarded."""
    wanted = sorted({signal.SIGUSR1, signal.SIGUSR2, *map(signal.Signals, forward)} - _TORCHRUN_SIGNALS - _KEPT)
    state = _Forwarded()

    def pass_on(signum, _frame):
        ranks = _ranks_of(error_dir)
        if not ranks:  # (none started yet, or no /proc to find them: torchrun's way, it stops them)
            if state.running:  # (outside torchrun's run: no job yet, or one that is over, whose end it would spoil)
                raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
            return
        state.passed.append(signum)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # (where handlers can be installed)
        previous = {s: signal.signal(s, pass_on) for s in wanted}
    try:
        yield state
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _torchruns_handlers_let_go():
    """torchrun's agent installs its handlers of _TORCHRUN_SIGNALS for good (they raise its SignalException):
    after the job, a Ctrl-C in this process (a notebook or a script that launched the job) raised torchrun's
    exception instead of KeyboardInterrupt. The handlers before the job are put back when it ends."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.getsignal(s) for s in _TORCHRUN_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # (None: a handler not installed from Python, which cannot be put back)
                signal.signal(s, handler)


def _ranks_of(error_dir: str) -> list[int]:
    """The PIDs of the ranks this launcher started: its child processes (Linux's /proc) whose environment has
    its error folder (not another child of the process, such as a multiprocessing helper)."""
    mark = f"{ERROR_DIR_ENV}={error_dir}".encode()
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in children.read_text().split()]
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(pid)
    return out


def _relaunch(nproc: int, argv: list[str], monitor_interval: float, error_dir: Path,
              forwarded: _Forwarded | None = None, kept: str = "") -> None:
    forwarded = forwarded or _Forwarded()
    command = argv[0] if argv else "train"  # (the longctx command the ranks run: the signal messages name it)
    args = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        f"--monitor-interval={monitor_interval}", "-m", "longctx", *argv,
    ])
    threads.share_cores(nproc)
    # the launcher's own lines ("Sending process ... closing signal SIGTERM") say nothing the
    # summary below does not; its errors still show
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.ERROR)
    workers = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    workers.addFilter(_no_failed_worker_line)
    try:
        forwarded.running = True
        try:
            with _torchruns_handlers_let_go(), torchrun_signals(workers) as torchrun_stopped:
                run(args)
        finally:
            forwarded.running = False
    except SignalException as e:
        # this launcher got the signal (torchrun's agent): it sent SIGTERM to the ranks and gave them
        # 30 s, in which ranks that save on a signal (checkpoint.on_signal) saved and said so
        _raise_preempted(_rank_errors(error_dir), nproc)
        if _all_finished(error_dir, nproc):  # (the run was whole: a 143 sent a finished run to be resumed)
            print(f"longctx: note: {signal.Signals(e.sigval).name} came after every rank had finished the run; "
                  f"nothing was stopped.", file=sys.stderr)
            return
        # the shell's code of a process a signal ended (130 for Ctrl-C, 143 for SIGTERM), as one process exits:
        # a script tells an interrupted run from a failed one (it exited 1, a failure's code)
        raise RankError(_stopped_by(signal.Signals(e.sigval).name, command, kept),
                        128 + int(e.sigval)) from None
    except ChildFailedError as e:
        hang = watchdog.hang_report(error_dir, nproc)
        if hang is not None:  # the ranks' watchdogs fired (parallel.timeout_s): say where each was, once
            summary, stacks = hang
            print(f"longctx: Python stacks of the ranks when the watchdog fired:\n{stacks}", file=sys.stderr)
            raise RankError(summary, watchdog.HANG_EXIT_CODE) from None
        errors = _rank_errors(error_dir)
        _raise_preempted(errors, nproc)
        if errors:
            lines = [f"{_ranks_label(ranks, nproc)}: {message}" for message, (ranks, _) in errors.items()]
            raise RankError("\n".join(lines), next(iter(errors.values()))[1]) from None
        raise _first_failure(e.failures, nproc, forwarded.passed, _noted_times(error_dir), command,
                             lost=_noted_times(error_dir, "lostpeer"), torchrun_stopped=torchrun_stopped,
                             kept=kept) from None
    finally:
        elastic.setLevel(level)
        workers.removeFilter(_no_failed_worker_line)


def _no_failed_worker_line(record: logging.LogRecord) -> bool:
    """torchrun's "failed (exitcode: 141) local_rank: 0 (pid: ...) of binary: ..." left out: the launcher's own
    summary names the rank, its exit and its error, and a rank's one-line error (a reader that closed stdout, as
    one process says it) read as two."""
    return not str(record.msg).startswith("failed (exitcode")


# what a job stopped by a signal leaves behind, by command, where the command does not say it (relaunch's `kept`:
# eval names its own .incomplete file, eval/stopped.py kept_where; train's checkpoints: _stopped_by)
_LEFT_BY_A_STOP = {
    "generate": "the lines it finished, if any, stay in --output's FILE.partial (FILE itself is written only by a "
                "whole run), or went to stdout; run it again for every line",
}


def _left_by_a_stop(command: str, kept: str) -> str:
    """What a stopped `command` (not train) keeps and where: the command's own `kept`, else _LEFT_BY_A_STOP's
    ('' when neither says): one rule for a stop by the launcher's signal and for one sent to a rank alone."""
    return kept or _LEFT_BY_A_STOP.get(command, "")


def _stopped_by(signame: str, command: str, kept: str = "") -> str:
    """The error of a job this launcher's signal (SIGTERM, Ctrl-C's SIGINT) stopped: for train, what its ranks
    save; for generate and eval, which save no checkpoint, what the command itself keeps (_left_by_a_stop)."""
    if command != "train":
        left = _left_by_a_stop(command, kept) or "run it again"
        return f"stopped by {signame} before `longctx {command}` finished (it saves no checkpoint): {left}."
    return (f"stopped by {signame} before the ranks saved a checkpoint (they save on checkpoint.on_signal when the "
            f"run saves: checkpoint.interval > 0 or checkpoint.final, from their set-up on; one that came while they "
            f"started, before it, stops them with nothing trained since the last checkpoint, which "
            f"`--checkpoint.resume auto` continues from).")


def _first_failure(failures: dict, nproc: int, passed=(), crashed: dict[int, float] | None = None,
                   command: str = "train", lost: dict[int, float] | None = None,
                   torchrun_stopped=frozenset(), kept: str = "") -> UserError:
    """The error to raise when no rank reported one of its own: which rank failed first and how, from
    `failures` (torchrun's ChildFailedError.failures, {rank: ProcessFailure}); `passed`: the signals the
    launcher passed on to the ranks (_forwarding); `crashed`: when ranks noted their own errors (note_crash);
    `command`: the job's (train's ranks save on a signal, generate's and eval's act on none); `lost`: when ranks
    noted a lost peer (note_lost_peer); `torchrun_stopped`: the PIDs torchrun signalled to stop the job; `kept`:
    relaunch's."""
    # The root cause: the rank torchrun saw end first. Its timestamps are whole seconds of one pass over the
    # ranks, and a rank it saw later ended later: one that outlived torchrun's SIGTERM (a rank records the signal
    # and goes on to its step boundary) is SIGKILLed by torchrun 30 s on, which is no out-of-memory killer's.
    # Within a second: a rank killed by a signal from outside (SIGKILL, OOM killer, segfault) before a rank
    # that exited with an error (the one that noted its error first, before one that did not), before a rank
    # stopped by a SIGTERM or SIGINT no one in the job sent (lost_peer.py: a `kill` of that rank alone, when no
    # rank noted an error of its own), before a rank that exited on losing a peer, before a rank the launcher or
    # torchrun itself stopped with a signal.
    crashed, lost = crashed or {}, lost or {}
    outside = set() if crashed else stopped_from_outside(failures, passed, torchrun_stopped)

    def cause(r):
        code = failures[r].exitcode or 0
        if r in outside:
            kind = 2
        elif code == 0 or stop_signal(code) is not None:
            kind = 4
        elif code < 0:
            kind = 0
        else:
            kind = 3 if r in lost else 1
        return failures[r].timestamp, kind, crashed.get(r, lost.get(r, math.inf)), r

    first_rank = min(failures, key=cause)
    failure = failures[first_rank]
    what = f"exit code {failure.exitcode}"
    if failure.exitcode is not None and failure.exitcode < 0:
        try:
            what = f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            pass
    others = sorted(set(failures) - {first_rank})
    if first_rank in outside:
        sig = stop_signal(failure.exitcode)
        said = outside_stop_message(first_rank, nproc, sig, failure.exitcode, sorted(set(lost) & set(others)),
                                    others, command, _left_by_a_stop(command, kept))
        return RankError(said, 128 + int(sig))
    signalled = failure.exitcode is not None and -failure.exitcode in passed  # (the launcher's signal, not a crash)
    message = (f"rank {first_rank} of {nproc} failed first ({what}); the job was stopped"
               + (f" (ranks {', '.join(map(str, others))} failed after it)" if others else "") + "."
               + (_LOST_FIRST if first_rank in lost and not signalled else
                  _failed_first_hint(failure.exitcode, what, signalled, command)))
    # (stopped by a signal: the shell's code of a process it ended, 128 + its number, as a signal torchrun catches)
    return RankError(message, 128 - failure.exitcode) if signalled else UserError(message)


# (the first rank to fail only lost a peer: its own line points here, and "see its output" would point back)
_LOST_FIRST = (" It only lost a peer mid-collective (its line above), and no rank failed before it: a rank that left "
               "the job without an error (exit 0) while the others were in a collective, most likely.")


def _failed_first_hint(exitcode: int | None, what: str, signalled: bool, command: str) -> str:
    """What _first_failure adds about the first failure's cause (`what`: how it ended, said)."""
    if signalled and command != "train":
        hint = (f" The launcher got {what[len('killed by '):]} and passed it on to the ranks, which ended by it "
                f"(`longctx {command}` does not act on it).")
    elif signalled:
        hint = (f" The launcher got {what[len('killed by '):]} and passed it on to the ranks, which do not stop on "
                f"it: a training run that saves checkpoints saves and stops on checkpoint.on_signal's signals.")
    elif exitcode == -signal.SIGKILL:
        hint = (" Nothing else stops a process without a word: most often it is the out-of-memory killer "
                "(see `dmesg`); the rank needed more memory than the machine had. Lower train.seq_len, "
                "use more ranks, or a memory policy (longctx plan picks one).")
    else:
        hint = " See that rank's output above for its error."
    return hint


def _raise_preempted(errors: dict[str, tuple[list[int], int]], nproc: int) -> None:
    """When every rank that reported stopped on a signal after saving (the same step on all), say so
    once and exit with the requeue code."""
    if errors and all(code == REQUEUE_EXIT_CODE for _, code in errors.values()):
        lines = [f"{_ranks_label(ranks, nproc)}: {message}" if len(errors) > 1 else message
                 for message, (ranks, _) in errors.items()]
        raise Preempted("\n".join(lines))


def _ranks_label(ranks: list[int], nproc: int) -> str:
    if len(ranks) == nproc and nproc > 1:
        return f"all {nproc} ranks"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {nproc}"
