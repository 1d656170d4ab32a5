"""A rank of `longctx <command> --nproc N` stopped by a signal sent to it alone (`kill -TERM PID`, a scheduler or a
container limit acting on one process): its peers lose it mid-collective and fail too, and the launcher must name
the rank the signal stopped, not a peer whose error was the echo of its loss.

Two facts make that call without timing the signal (a Python handler in the ranks would run only between bytecodes
of the main thread, not while it waits in a collective's C++ code): a rank whose error is a process group's lost
peer says so (note_lost_peer, not note_crash), and the launcher knows which ranks torchrun itself signalled when it
stopped the job (torchrun_signals), so a rank ended by SIGTERM or SIGINT that neither torchrun nor the launcher sent
was stopped from outside.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal

# The process group's own words for a peer that went away, as torch raises them (a RuntimeError / DistBackendError).
# gloo (third_party/gloo/gloo/transport/tcp/pair.cc, GLOO_ERROR_MSG: "[<file>:<line>] " first, then the peer's
# address as Address::str() writes it, "[127.0.0.1]:55716"): the peer's socket closed ("Connection closed by peer
# [addr]"), or a read or write on it failed with the system's ECONNRESET / EPIPE text ("Read error [addr]: Connection
# reset by peer", "writev [addr]: Broken pipe"). Only that whole shape counts: "Broken pipe" or "Connection reset by
# peer" anywhere else is a pipe or socket of the rank's own (a data worker's, a subprocess's), its own error. NCCL
# (torch's NCCLUtils getNcclErrorDetailStr and NCCL's own ncclGetErrorString for ncclRemoteError). A timeout is not
# among them: a peer that is slow, stuck or gone looks the same there, and the watchdog (parallel.timeout_s) says
# which.
_GLOO_PEER = r"\[[^\]\s]*\](?::\d+)?(?:\$\d+)?"  # (Address::str(): "[ip]:port", "[ip]", a "$seq" after it)
GLOO_LOST_PEER = re.compile(rf"pair\.cc:\d+\] (?:Connection closed by peer {_GLOO_PEER}|(?:Read error|writev) "
                            rf"{_GLOO_PEER}: (?:Connection reset by peer|Broken pipe))")
LOST_PEER_TEXTS = (
    "ncclRemoteError",
    "remote process exited or there was a network error",
)

# the exits of a rank a SIGTERM or SIGINT ended: its default action (-N), or the rank's own stop on it (128 + N:
# `longctx eval` keeps its finished lengths, eval/stopped.py; Ctrl-C's KeyboardInterrupt exits 130)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_signal(exitcode: int | None) -> signal.Signals | None:
    """The SIGTERM or SIGINT that ended a process with `exitcode` (see STOP_SIGNALS), else None."""
    for s in STOP_SIGNALS:
        if exitcode in (-s, 128 + s):
            return s
    return None


def stopped_from_outside(failures: dict, passed=(), torchrun_stopped=frozenset()) -> set[int]:
    """The ranks of `failures` ({rank: torchrun's ProcessFailure}) ended by a SIGTERM or SIGINT that neither the
    launcher passed on (`passed`, its signals) nor torchrun sent (`torchrun_stopped`, the PIDs it signalled)."""
    return {r for r, f in failures.items()
            if (s := stop_signal(f.exitcode)) is not None and s not in passed
            and getattr(f, "pid", None) not in torchrun_stopped}


def root_error(error: BaseException) -> BaseException:
    """The first error of `error`'s chain: the one the others were raised from or while handling."""
    seen = {id(error)}
    while (earlier := error.__cause__ or error.__context__) is not None and id(earlier) not in seen:
        seen.add(id(earlier))
        error = earlier
    return error


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` began as the process group's loss of a peer (GLOO_LOST_PEER, LOST_PEER_TEXTS): not this rank's
    own failure but its echo. Only the chain's first error counts: a lost peer in a clean-up after an error of the
    rank's own (a collective in a `finally`) is the echo, and the rank's own error the cause. torch raises these as a
    RuntimeError (DistBackendError is one); an OSError's "Broken pipe" is a closed stdout, this rank's own."""
    root = root_error(error)
    text = str(root)
    return isinstance(root, RuntimeError) and (GLOO_LOST_PEER.search(text) is not None
                                               or any(t in text for t in LOST_PEER_TEXTS))


class _TorchrunSignals(logging.Filter):
    """On torchrun's worker logger: notes the PIDs its agent sends a closing signal when it stops a job (its warning
    "Sending process PID closing signal SIGTERM", api.py _close; tests/unit/test_blame111.py holds torch to it), and
    lets no record below ERROR through (the launcher shows none of torchrun's warnings)."""

    def __init__(self):
        super().__init__()
        self.pids: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Sending process") and isinstance(record.args, tuple) and record.args:
            with contextlib.suppress(TypeError, ValueError):
                self.pids.add(int(record.args[0]))
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def torchrun_signals(workers: logging.Logger):
    """While torchrun runs a job: the set of the PIDs it signalled itself to stop the job (filled as it does)."""
    noted = _TorchrunSignals()
    level = workers.level
    workers.setLevel(logging.WARNING)  # (its warnings are made, to be read here and shown nowhere)
    workers.addFilter(noted)
    try:
        yield noted.pids
    finally:
        workers.removeFilter(noted)
        workers.setLevel(level)


def outside_stop_message(rank: int, nproc: int, sig: signal.Signals, exitcode: int, lost: list[int],
                         others: list[int], command: str, kept: str = "") -> str:
    """What the launcher says of rank `rank`, stopped by `sig` that no one in the job sent (see the module's
    docstring): `lost`, the ranks that noted it lost mid-collective; `others`, the rest that ended after it;
    `kept`, what the command keeps of a stopped run and where (eval's finished lengths: its .incomplete file)."""
    how = "" if exitcode == -sig else f" (it exited {exitcode}, as a process {sig.name} stops)"
    after = []
    if lost:
        after.append(f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} then lost it mid-collective")
    stopped = [r for r in others if r not in lost]
    if stopped:
        after.append(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} "
                     f"{'were' if len(stopped) > 1 else 'was'} stopped after it")
    said = (f"rank {rank} of {nproc} was stopped by {sig.name}{how}, which the launcher did not send: a signal sent "
            f"to that rank alone (`kill`, a scheduler, a container's limit); the job was stopped"
            + (f" ({'; '.join(after)})" if after else "") + ".")
    if command == "train":
        said += (" A training run that saves checkpoints stops on it at a step boundary after saving "
                 "(checkpoint.on_signal), on every rank.")
    elif kept:
        said += f" Of what `longctx {command}` finished: {kept}."  # (no checkpoint to speak of, unlike train)
    return said
