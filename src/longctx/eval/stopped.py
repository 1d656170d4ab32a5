"""What `longctx eval` keeps when a run stops part-way (an error at one length, out of memory at the longest,
Ctrl-C, SIGTERM): the lengths each task finished, marked `"incomplete"` (what stopped it, the lengths done and those not
run), written to --output's name with .incomplete (out.json -> out.incomplete.json), or to stdout without
--output. --output itself is written only by a finished run, so an earlier result there stays whole and is
never mixed with this run's figures; a finished run removes the .incomplete file an earlier stopped run left
beside it (its cells are no longer the latest). A run stopped before any length was done writes nothing and
says so. Only rank 0 holds results (EvalRequest.result), so only it writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .. import strict_json
from ..durable import write_text_durably, written_in_place
from ..progress import say
from .task_list import combine

if TYPE_CHECKING:
    from .request import EvalRequest

REASON_CHARS = 300  # what stopped the run, in the JSON: an exception's message at most this long


def incomplete_path(output: str) -> str:
    """Where a stopped run's finished lengths go: --output's name with .incomplete before its suffix (a stream
    such as /dev/stdout, written where it is, takes them itself)."""
    if written_in_place(output):
        return output
    path = Path(output)
    return str(path.with_name(f"{path.stem}.incomplete{path.suffix or '.json'}"))


def kept_where(output: str) -> str:
    """Where a stopped run's finished lengths are, said by the launcher of `--nproc N` when a rank was stopped from
    outside (job/lost_peer.py outside_stop_message; rank 0's own line, above it, may be far up in the ranks' output)."""
    if not output:
        where = "went to stdout (rank 0's JSON above)"
    elif written_in_place(output):
        where = f"went to {output}"
    else:
        where = f"are kept in {incomplete_path(output)} (--output {output} is written only by a whole run)"
    return f"the lengths it finished, if any, {where}, marked \"incomplete\"; run it again for the others"


def replacing_note(output: str) -> str:
    """The note that --output holds a file already ('' when not): said before work, so that an earlier result is
    never replaced without a word (and a run stopped part-way leaves it as it is)."""
    if not output or not os.path.isfile(output) or written_in_place(output):
        return ""
    return (f"--output {output} exists: it is replaced once the evaluation is done (a run stopped part-way leaves "
            f"it as it is and keeps its finished lengths in {incomplete_path(output)})")


class Terminated(SystemExit):
    """SIGTERM during the evaluation (a scheduler's time limit, torchrun stopping the ranks after one failed): an
    exception, so that the lengths finished are kept as on Ctrl-C; the process then exits 143, as the signal's
    default action would have ended it."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def terminated_raises():
    """SIGTERM raises Terminated in the main thread while the block runs (where the signal's action is the
    default one: a program embedding eval keeps its own handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    # the handler runs wherever the main thread is: in a weakref callback or a __del__ (a collection of torch's
    # objects), where Python prints an exception and drops it ("Exception ignored in ..."), Terminated was lost
    # and the run went on to its end, exit 0 (2 runs in 8 of a 2-rank ppl eval): the signal is sent again, from
    # another thread, and the handler runs at one of the main thread's next steps
    unraisable = sys.unraisablehook
    resending = False  # (in _again: a Terminated raised there would be dropped as well)

    def _send_again():
        again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()

    def _raise(signum, frame):
        if resending:
            _send_again()
            return
        raise Terminated()

    def _again(lost):
        nonlocal resending
        if not isinstance(lost.exc_value, Terminated):
            unraisable(lost)
            return
        resending = True
        try:
            _send_again()
        finally:
            resending = False

    signal.signal(signal.SIGTERM, _raise)
    sys.unraisablehook = _again
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.unraisablehook = unraisable


def stop_reason(error: BaseException) -> str:
    """What stopped the run, in a line."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(error, Terminated):
        return "terminated (SIGTERM)"
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def stopped_result(requests: list[EvalRequest], error: BaseException, seconds: float) -> dict | None:
    """The result of the lengths finished before `error` stopped the run, in the shape a finished run's has (one
    task: its result; several: the combined object, with the tasks that finished a length), `"incomplete"` its
    first key; None when no length was finished."""
    started = [r for r in requests if r.result is not None and r.result["results"]]
    if not started:
        return None
    reason = {"stopped_by": stop_reason(error)}
    if len(requests) == 1:
        part = _stopped_part(started[0])
        return {"incomplete": {**reason, **part.pop("incomplete", {})}, **part}
    not_run = [r.task for r in requests if r not in started]
    out = combine([_stopped_part(r) for r in started], requests[0].lengths, seconds)
    return {"incomplete": {**reason, "tasks_not_run": not_run}, **out}


def _stopped_part(request: EvalRequest) -> dict:
    """A task's result as far as it went: its finished lengths; with `"incomplete"` (the lengths done and not
    run) and, for passkey / needle, the accuracy over the finished cells when it stopped inside the task."""
    out = dict(request.result)
    done = list(dict.fromkeys(r["length"] for r in out["results"]))
    missing = [n for n in request.lengths if n not in done]
    if not missing:  # (finished: as it is)
        return out
    if request.task != "ppl":
        rows = out["results"]
        out["accuracy"] = sum(r["correct"] for r in rows) / sum(r["samples"] for r in rows)
    return {"incomplete": {"lengths_done": done, "lengths_not_run": missing}, **out}


def keep_stopped(requests: list[EvalRequest], args, error: BaseException, seconds: float) -> None:
    """Rank 0, as the run stops on `error` (re-raised by the caller): the finished lengths written (stdout
    without --output) and said, or said that none was."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    result = stopped_result(requests, error, seconds)
    left = f"; --output {args.output} was not written" if args.output else ""
    if result is None:
        if any(r.result is not None for r in requests) or isinstance(error, (KeyboardInterrupt, Terminated)):
            say(f"eval: stopped ({stop_reason(error)}) before any length was done: no result kept{left}.")
        return
    text = strict_json.dumps(result, indent=1)
    if not args.output:
        print(text)
        say(f"eval: stopped ({stop_reason(error)}): the result above holds only the lengths done, marked "
            f"\"incomplete\".")
        return
    path = incomplete_path(args.output)
    try:
        write_output(path, text + "\n")
    except Exception as e:  # (the run's own error is the one raised: this one is said)
        say(f"eval: stopped ({stop_reason(error)}); the lengths done could not be kept in {path}: {e}{left}.")
        return
    if path != args.output:
        left += " (an earlier result there stays as it was)" if os.path.isfile(args.output) else ""
    say(f"eval: stopped ({stop_reason(error)}): the lengths done are kept in {path}, marked \"incomplete\"{left}.")


def write_output(path: str, text: str) -> None:
    """An eval JSON written to `path`: a regular file replaced whole (a temporary renamed over it: a failed write
    leaves the previous file whole), a stream (/dev/stdout, a pipe: durable.py written_in_place) written where it
    is, as check_output_path accepted it; a rename would put a regular file in its place (as root, over
    /dev/stdout itself) and the reader would get nothing."""
    if written_in_place(path):
        with open(path, "w") as f:
            f.write(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(Path(path), text)


def drop_stale_incomplete(output: str) -> None:
    """After a finished run wrote --output: the .incomplete file an earlier stopped run left beside it is removed
    (said), so that no older partial figures sit beside the new result as if they were its."""
    path = incomplete_path(output) if output else ""
    if not path or path == output or not os.path.isfile(path):
        return
    try:
        held = json.loads(Path(path).read_text())
        stale = isinstance(held, dict) and "incomplete" in held
    except (OSError, ValueError):
        stale = False
    if stale:  # (only a file this command wrote: one that says it is incomplete)
        os.unlink(path)
        say(f"eval: removed {path}, the lengths an earlier stopped run kept (this run's result is {output})")
