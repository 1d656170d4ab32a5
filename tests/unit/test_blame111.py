"""A rank of `longctx <command> --nproc N` stopped by a signal sent to it alone (helper task blame111).

Failed before: `kill -TERM <rank 1's pid>` in a 2-rank `longctx train` that saves nothing said "rank 0 of 2 failed
first (killed by SIGTERM); the job was stopped (ranks 1 failed after it). See that rank's output above for its
error.", exit 1 (or "(exit code 1)", rank 0's traceback of gloo's "Connection reset by peer" shown as the cause).
A SIGTERM or SIGINT exit was ranked as the launcher's own stop, after any error; rank 0's loss of its peer noted a
crash of its own (note_crash); and when torchrun's SIGTERM reached rank 0 before it raised, both ranks ended by
SIGTERM and the lower rank was named. Now a rank that loses a peer notes that (note_lost_peer), the launcher knows
which ranks torchrun signalled (lost_peer.torchrun_signals), and the rank no one in the job signalled is named,
with its signal, exit 128 + the signal.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_launch_audit_first_failure import _failure, _launcher_says
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from longctx import cli
from longctx.errors import UserError
from longctx.job import relaunch

TERM, INT, KILL = int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGKILL)
# the errors a 2-rank CPU job's rank 0 raised when its peer was killed (seen in this task's runs)
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:55716. This is typically caused by a remote worker crashing.")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:14767: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")
# (gloo's write failure, pair.cc's "writev <peer>: <errno text>": gloo has no "Write error")
GLOO_EPIPE = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:339] writev [::1]:5: Broken pipe"


def _ended(**exits) -> dict:
    """{rank: a ProcessFailure-like} from r0=..., r1=...: (exit code, torchrun's second)."""
    return {int(k[1:]): SimpleNamespace(exitcode=code, timestamp=t, pid=1000 + int(k[1:]))
            for k, (code, t) in exits.items()}


def _said(error) -> str:
    return " ".join(str(error).split())


# ---- the new case: a rank stopped by a signal no one in the job sent


@pytest.mark.parametrize("exit_code", [-TERM, 128 + TERM])  # (the default action's; eval's own stop on it)
def test_a_rank_sigtermed_alone_is_named_not_its_peer_that_lost_it(exit_code):
    failures = _ended(r0=(1, 100), r1=(exit_code, 100))
    error = relaunch._first_failure(failures, 2, [], {}, "generate", lost={0: 5.0}, torchrun_stopped=set())
    said = _said(error)
    assert said.startswith("rank 1 of 2 was stopped by SIGTERM"), said
    assert "which the launcher did not send" in said and "rank 0 then lost it mid-collective" in said, said
    assert "failed first" not in said and "checkpoint" not in said, said
    assert isinstance(error, relaunch.RankError) and error.exit_code == 143


def test_when_torchruns_sigterm_reached_the_peer_first_the_rank_it_did_not_signal_is_named():
    """Both ranks ended by SIGTERM in one second (HEAD named rank 0, the lower): torchrun signalled rank 0."""
    failures = _ended(r0=(-TERM, 100), r1=(-TERM, 100))
    error = relaunch._first_failure(failures, 2, [], {}, "train", lost={}, torchrun_stopped={1000})
    said = _said(error)
    assert said.startswith("rank 1 of 2 was stopped by SIGTERM"), said
    assert "rank 0 was stopped after it" in said and "checkpoint.on_signal" in said, said  # (train's hint)
    assert error.exit_code == 143


@pytest.mark.parametrize("exit_code", [-INT, 128 + INT])  # (SIGINT's action; Ctrl-C's KeyboardInterrupt, 130)
def test_a_rank_sent_sigint_alone_is_named_with_sigints_code(exit_code):
    error = relaunch._first_failure(_ended(r0=(1, 100), r1=(exit_code, 100)), 2, [], {}, "eval", lost={0: 5.0})
    assert _said(error).startswith("rank 1 of 2 was stopped by SIGINT"), _said(error)
    assert error.exit_code == 130


def test_of_three_ranks_the_one_signalled_from_outside_is_named_before_torchruns_and_the_lost():
    failures = _ended(r0=(1, 100), r1=(-TERM, 100), r2=(-TERM, 100))
    error = relaunch._first_failure(failures, 3, [], {}, "generate", lost={0: 5.0}, torchrun_stopped={1001})
    said = _said(error)
    assert said.startswith("rank 2 of 3 was stopped by SIGTERM"), said
    assert "rank 0 then lost it mid-collective; rank 1 was stopped after it" in said, said


# ---- the ordering around it, unchanged


def test_a_rank_that_noted_an_error_of_its_own_is_still_named_before_a_sigterm():
    """A real error (note_crash) and torchrun's SIGTERM of the peer; also when torchrun's signals went unseen."""
    for stopped in ({1000}, set()):
        error = relaunch._first_failure(_ended(r0=(-TERM, 100), r1=(1, 100)), 2, [], {1: 5.0}, "train",
                                        lost={}, torchrun_stopped=stopped)
        assert _said(error).startswith("rank 1 of 2 failed first (exit code 1)"), _said(error)
        assert type(error) is UserError  # (exit 1)


def test_an_error_without_a_note_still_comes_before_a_sigterm_no_one_is_known_to_have_sent():
    """test_review109's case: torchrun stopped rank 0 (exit 143) after rank 1's error; nothing else known."""
    error = relaunch._first_failure(_ended(r0=(143, 100), r1=(1, 100)), 2, [], {}, "eval")
    assert _said(error).startswith("rank 1 of 2 failed first (exit code 1)"), _said(error)


@pytest.mark.parametrize("killed", [-KILL, -int(signal.SIGSEGV)])
def test_a_rank_killed_by_another_signal_is_named_before_a_sigterm_and_the_oom_hint_stays(killed):
    error = relaunch._first_failure(_ended(r0=(-TERM, 100), r1=(killed, 100)), 2, [], {}, "train",
                                    lost={}, torchrun_stopped=set())
    said = _said(error)
    assert said.startswith(f"rank 1 of 2 failed first (killed by {signal.Signals(-killed).name})"), said
    assert ("out-of-memory killer" in said) == (killed == -KILL), said


def test_a_sigterm_seen_in_a_later_second_than_a_peers_failure_is_not_named():
    """torchrun's timestamps first: the lost peer's exit at 100, a SIGTERM no one is known to have sent at 101."""
    error = relaunch._first_failure(_ended(r0=(1, 100), r1=(-TERM, 101)), 2, [], {}, "train", lost={0: 5.0})
    assert _said(error).startswith("rank 0 of 2 failed first (exit code 1)"), _said(error)


def test_a_lost_peer_still_comes_before_the_ranks_torchrun_stopped():
    """A rank lost a peer that ended well (exit 0 is no failure); torchrun stopped the other."""
    error = relaunch._first_failure(_ended(r0=(1, 100), r2=(-TERM, 100)), 3, [], {}, "train", lost={0: 5.0},
                                    torchrun_stopped={1002})
    assert _said(error).startswith("rank 0 of 3 failed first (exit code 1)"), _said(error)


def test_a_signal_the_launcher_passed_on_keeps_its_message():
    failures = _ended(r0=(-TERM, 100), r1=(-TERM, 100))
    error = relaunch._first_failure(failures, 2, [signal.SIGTERM], {}, "generate", lost={}, torchrun_stopped=set())
    assert "passed it on to the ranks" in _said(error) and error.exit_code == 143, _said(error)


# ---- the rank's side: a lost peer is noted, not presented as the cause


@pytest.mark.parametrize("text", [GLOO_CLOSED, GLOO_RESET, GLOO_EPIPE,
                                  "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
                                  "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due "
                                  "to a network error or a remote process exiting prematurely."])
def test_the_process_groups_lost_peer_errors_are_recognised(text):
    from longctx.job import lost_peer

    assert lost_peer.lost_a_peer(RuntimeError(text))
    try:  # (wrapped: raised from it, or while handling it)
        try:
            raise RuntimeError(text)
        except RuntimeError as lost:
            raise ValueError("the step failed") from lost
    except ValueError as e:
        assert lost_peer.lost_a_peer(e)


def test_an_error_of_the_ranks_own_is_no_lost_peer_even_if_a_collective_lost_one_after_it():
    from longctx.job import lost_peer

    assert not lost_peer.lost_a_peer(RuntimeError("CUDA out of memory"))
    assert not lost_peer.lost_a_peer(BrokenPipeError(32, "Broken pipe"))  # (a closed stdout: the rank's own)
    try:
        try:
            raise KeyError("the rank's own error")
        finally:
            raise RuntimeError(GLOO_CLOSED)  # (a collective in a clean-up, after its peer went away)
    except RuntimeError as e:
        assert not lost_peer.lost_a_peer(e)


def test_a_rank_that_lost_its_peer_notes_it_instead_of_a_crash_and_the_launcher_names_the_peer(
        tmp_path, monkeypatch, capsys):
    def losing_train(_args, _overrides):
        raise RuntimeError(GLOO_RESET)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(cli, "_cmd_train", losing_train)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    monkeypatch.setenv(relaunch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as ended:
        cli.main(["train"])
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert "[rank 0] longctx train: lost a peer mid-collective (" in err and "Connection reset by peer" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lostpeer0.json"]  # (no crash0.json)
    assert "Connection reset by peer" in json.loads((tmp_path / "lostpeer0.json").read_text())["error"]

    failures = {0: _failure(0, 1, 100, tmp_path), 1: _failure(1, -TERM, 100, tmp_path)}
    said = " ".join(_launcher_says(failures, tmp_path, monkeypatch).split())
    assert said.startswith("rank 1 of 2 was stopped by SIGTERM, which the launcher did not send"), said
    assert "rank 0 then lost it mid-collective" in said, said


def test_the_launcher_learns_which_ranks_torchrun_signalled_from_its_agent(tmp_path, monkeypatch):
    """_relaunch's wiring: torchrun's "Sending process PID closing signal SIGTERM" (for rank 0) reaches
    _first_failure, so of two ranks ended by SIGTERM the other is named; and no warning of torchrun's shows."""
    failures = {0: _failure(0, -TERM, 100, tmp_path), 1: _failure(1, -TERM, 100, tmp_path)}
    shown = []
    handler = logging.Handler()
    handler.emit = shown.append
    logging.getLogger().addHandler(handler)

    def run(_args):
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").warning(
            "Sending process %s closing signal %s", failures[0].pid, "SIGTERM")
        raise ChildFailedError("longctx", failures)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        with pytest.raises(relaunch.RankError) as caught:
            relaunch._relaunch(2, ["generate"], 0.5, tmp_path)
    finally:
        logging.getLogger().removeHandler(handler)
    said = " ".join(str(caught.value).split())
    assert said.startswith("rank 1 of 2 was stopped by SIGTERM"), said
    assert caught.value.exit_code == 143 and not shown


@pytest.fixture
def handlers_kept():
    """torch's process context installs its own handler of these signals for good (PContext.start): put back the
    worker's, else a later test in this process meets torch's SIGTERM handler (eval's terminated_raises then, as it
    should, leaves a handler it did not install alone, and test_eval_lost_sigterm110 failed in a full run)."""
    signals = [s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)]
    before = {s: signal.getsignal(getattr(signal, s)) for s in signals}
    yield
    for s, handler in before.items():
        signal.signal(getattr(signal, s), handler)


def test_torchruns_agent_still_says_which_processes_it_signals(tmp_path, handlers_kept):
    """torch's own words, which torchrun_signals reads: a real torchrun process context closing two workers."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from longctx.job import lost_peer

    context = start_processes("blame111", sys.executable, {r: ("-c", "import time; time.sleep(60)") for r in (0, 1)},
                              {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=str(tmp_path)))
    workers = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    try:
        with lost_peer.torchrun_signals(workers) as signalled:
            pids = set(context.pids().values())
            context.close()
    finally:
        for pid in context.pids().values():  # (nothing left running whatever happened)
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    assert signalled == pids and len(pids) == 2
