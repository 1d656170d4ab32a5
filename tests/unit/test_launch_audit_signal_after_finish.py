"""A SIGTERM (Slurm's, a time limit's) that reaches `longctx train --nproc N`'s launcher once the ranks have finished
the run: torchrun's agent raises on it whatever its ranks do, and the launcher said "stopped by SIGTERM before the
ranks saved a checkpoint", exit 143, for a run that had trained every step and saved its final checkpoint (seen: 2
CPU ranks, train.steps 3, SIGTERM to the launcher at the done line: step-00000003 saved, exit 143)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from longctx import cli
from longctx.config import load_config
from longctx.job import relaunch
from longctx.train import trainer


def _signalled_launch(folder, monkeypatch) -> None:
    def run(_args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (share_cores would set it for the ranks)
    relaunch._relaunch(2, ["train"], 0.5, folder)


def _finish_rank(rank: int, folder, monkeypatch) -> None:
    """A rank of the launch runs `longctx train` to its end (its training stubbed: the ending is the subject)."""
    monkeypatch.setenv(relaunch.ERROR_DIR_ENV, str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(trainer, "train", lambda cfg, preflighted: None)
    monkeypatch.setattr(cli.threads, "fit_to_idle_cores", lambda: None)
    assert cli._train(SimpleNamespace(), [], load_config(), 2, launching=False, resumed=False) == 0


def test_a_signal_after_every_rank_finished_is_no_failure(tmp_path, monkeypatch, capsys):
    for rank in range(2):
        _finish_rank(rank, tmp_path, monkeypatch)
    _signalled_launch(tmp_path, monkeypatch)  # (no error: the run is whole)
    assert "after every rank had finished the run" in capsys.readouterr().err


def test_a_signal_before_a_rank_finished_still_stops_the_job_with_its_code(tmp_path, monkeypatch):
    _finish_rank(0, tmp_path, monkeypatch)
    with pytest.raises(relaunch.RankError, match="stopped by SIGTERM") as caught:
        _signalled_launch(tmp_path, monkeypatch)
    assert caught.value.exit_code == 128 + int(signal.SIGTERM)


def test_a_rank_not_launched_by_longctx_notes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "train", lambda cfg, preflighted: None)
    monkeypatch.setattr(cli.threads, "fit_to_idle_cores", lambda: None)
    monkeypatch.delenv(relaunch.ERROR_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli._train(SimpleNamespace(), [], load_config(), 1, launching=False, resumed=False) == 0
    assert not list(tmp_path.iterdir())


def test_the_launchers_signal_handlers_are_put_back_after_the_job(tmp_path, monkeypatch):
    """torchrun's agent installs its SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers for good: after a job launched from
    Python, a Ctrl-C raised its SignalException instead of KeyboardInterrupt (CI saw it in a later test)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    def run(_args):  # (what torchrun's PContext.start does in the main thread)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(s, _terminate_process_handler)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        relaunch._relaunch(2, ["train"], 0.5, tmp_path)
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
