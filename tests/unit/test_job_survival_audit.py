"""The job floor under a scheduler: what the launcher of `--nproc N` gives its ranks and does with a signal."""

import os
import signal

import pytest

from longctx import threads
from longctx.job import relaunch


def test_each_rank_gets_its_share_of_the_cores_it_may_run_on(monkeypatch):
    # a Slurm cpuset / taskset: 2 usable cores on a machine of 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 7}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LONGCTX_THREADS_FROM", raising=False)
    threads.share_cores(2)
    assert os.environ["OMP_NUM_THREADS"] == str(len({3, 7}) // 2)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the ranks through Linux's /proc")
def test_a_user_signal_is_passed_on_to_the_launchers_ranks_and_the_launcher_waits(monkeypatch, tmp_path):
    """Inside relaunch, SIGUSR1 to the launcher reaches its ranks (children whose environment has its error
    folder) and not another child; the launcher itself goes on (no SignalException: torchrun would stop them)."""
    import subprocess
    import sys
    import time

    got = []

    def run(args):  # stands for torchrun: starts a rank and a helper, then the launcher is signalled
        folder = os.environ[relaunch.ERROR_DIR_ENV]
        code = ("import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75)); "
                "print('ready', flush=True); time.sleep(30)")
        rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        env = {k: v for k, v in os.environ.items() if k != relaunch.ERROR_DIR_ENV}
        helper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        assert rank.stdout.readline() == "ready\n" and helper.stdout.readline() == "ready\n"
        assert folder
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # (the handler runs in this, the main, thread)
        try:
            got.append(rank.wait(timeout=5))
        except subprocess.TimeoutExpired:
            rank.kill()
            got.append(rank.wait())
        time.sleep(0.3)
        got.append(helper.poll())
        helper.kill()
        helper.wait()

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    kept = []  # (the process's own handler: without the launcher's, the signal stays here, and pytest lives)

    def before(signum, _frame):
        kept.append(signum)

    previous = signal.signal(signal.SIGUSR1, before)
    try:
        relaunch.relaunch(2, ["train"])
        assert signal.getsignal(signal.SIGUSR1) is before  # the launcher's handler is let go with the job
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [75, None] and not kept  # the rank acted on it; the other child never got it


def test_ranks_ended_by_a_signal_the_launcher_passed_on_are_said_so_with_its_exit_code():
    """A run whose ranks do not stop on SIGUSR1 (eval, generate, a run that saves nothing): they end by it,
    and the launcher says it passed the signal on, with the shell's code of a process the signal ended."""
    from types import SimpleNamespace

    failures = {r: SimpleNamespace(exitcode=-int(signal.SIGUSR1), timestamp=100 + r) for r in range(2)}
    error = relaunch._first_failure(failures, 2, [signal.SIGUSR1])
    assert "passed it on to the ranks" in str(error) and "SIGUSR1" in str(error)
    assert error.exit_code == 128 + int(signal.SIGUSR1)
    crashed = relaunch._first_failure(failures, 2, [])  # (a signal nobody passed on: a crash, said as one)
    assert "passed it on" not in str(crashed)


def test_a_watchdog_whose_folder_takes_no_file_still_fires_and_says_where_on_stderr(tmp_path, capsys):
    """The launcher's error folder gone or full (an inode quota, a read-only /tmp): the record goes to stderr
    and the rank still ends (here: `fired`), not the watchdog's thread dying of the OSError with the rank hung."""
    from longctx.job import watchdog

    code = compile("def all_reduce(seconds):\n    import time; time.sleep(seconds)\n",
                   "/x/torch/distributed/distributed_c10d.py", "exec")
    fake = {}
    exec(code, fake)  # (a frame that looks like a wait in a collective)
    w = watchdog.Watchdog(0.5, rank=2, folder=tmp_path / "gone", exit_process=False).start()
    try:
        watchdog.phase(5, "backward")
        fake["all_reduce"](2.0)
    finally:
        w.stop()
    assert w.fired.is_set()
    err = capsys.readouterr().err
    assert "[rank 2]" in err and "step 5, backward, waiting in a collective" in err


def test_a_full_disk_at_the_plots_leaves_a_finished_run_finished(tmp_path, monkeypatch):
    """The plots are written after the last step and its checkpoint: a full disk there raised a raw OSError,
    and the command failed (exit 1) with the run trained and saved. Now a note, and the run finishes."""
    import errno

    from matplotlib.figure import Figure

    from longctx.config import load_config
    from longctx.train.trainer import train

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full)
    said = []
    cfg = load_config(None, ["--train.steps=2", "--train.seq_len=64", "--data.max_docs=20", "--model.layers=1",
                             "--metrics.progress=false", "--train.eval_interval=0", "--checkpoint.interval=1",
                             "--train.device=cpu", f"--train.run_dir={tmp_path / 'run'}"])
    result = train(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert len(result.losses) == 2 and (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()
    note = [line for line in said if "plots could not be written" in line]
    assert len(note) == 1 and os.strerror(errno.ENOSPC) in note[0] and "longctx report" in note[0]
    assert not any("and plots" in line for line in said)  # (the last line does not send the reader to them)


def test_the_launcher_never_catches_its_childrens_endings_or_its_own_faults(monkeypatch):
    """checkpoint.on_signal may name any catchable signal; the launcher forwards the ones that stop a process
    (SIGALRM here), never SIGCHLD (each child's exit would stop or signal the job) nor a fault of its own."""
    caught = {}

    def run(args):
        caught.update({s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGSEGV, signal.SIGALRM)})

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGSEGV)}
    relaunch.relaunch(2, ["train"], forward=[signal.SIGCHLD, signal.SIGSEGV, signal.SIGALRM])
    assert {s: caught[s] for s in before} == before
    assert callable(caught[signal.SIGALRM]) and caught[signal.SIGALRM] not in (signal.SIG_DFL, signal.SIG_IGN)


def test_a_user_signal_before_any_rank_started_stops_the_launch_with_its_code(monkeypatch):
    """No rank to pass it on to yet (torchrun's rendezvous): torchrun's way, the launch stops, said as a signal
    that came before the ranks saved (128 + its number), not a traceback and not a signal lost."""
    import time

    from longctx.errors import UserError

    def run(args):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1.0)  # (the handler raises here, in the main thread)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(UserError, match="stopped by SIGUSR1") as e:
        relaunch.relaunch(2, ["train"])
    assert e.value.exit_code == 128 + int(signal.SIGUSR1)
