"""Which rank `longctx train --nproc N` names as the one that failed first, when no rank handed over a UserError.

torchrun captures its ranks' failures in one pass, timestamped to the second, and SIGKILLs a rank that outlives
its SIGTERM by 30 s. Seen on 2 CPU ranks, rank 1 raising a RuntimeError (4 runs): twice "rank 0 of 2 failed first
(exit code 1)" (rank 0's consequential "Connection reset by peer" in the same second), once "rank 0 ... killed by
SIGKILL ... most often it is the out-of-memory killer" (rank 0, waiting in set-up, killed by torchrun itself).
"""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from longctx import cli
from longctx.errors import UserError
from longctx.job import relaunch


def _failure(rank: int, exitcode: int, timestamp: int, folder) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                             error_file=str(folder / f"no-error-file-{rank}"))
    failure.timestamp = timestamp  # (torchrun's: int(time.time()) when its monitor saw the exit)
    return failure


def _launcher_says(failures: dict, folder, monkeypatch) -> str:
    """What the launcher raises when torchrun's run ends in `failures` and the ranks left `folder`."""
    def run(_args):
        raise ChildFailedError("longctx", failures)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (share_cores would set it for the ranks)
    with pytest.raises(UserError) as caught:
        relaunch._relaunch(2, ["train"], 0.5, folder)
    return str(caught.value)


def test_a_rank_torchrun_killed_after_its_grace_is_not_named_as_the_first_failure(tmp_path, monkeypatch):
    """Rank 1 raised (captured at 100); rank 0, stuck in set-up and deaf to the SIGTERM it only records, was
    SIGKILLed by torchrun 30 s later: rank 1 failed first, and no out-of-memory killer was involved."""
    failures = {0: _failure(0, -int(signal.SIGKILL), 130, tmp_path), 1: _failure(1, 1, 100, tmp_path)}
    said = _launcher_says(failures, tmp_path, monkeypatch)
    assert said.startswith("rank 1 of 2 failed first (exit code 1)"), said
    assert "out-of-memory" not in said


def test_a_rank_killed_from_outside_is_still_named_before_its_peers_that_failed_in_the_same_second(
        tmp_path, monkeypatch):
    """The out-of-memory killer's SIGKILL on rank 1, rank 0's connection error seen in the same pass."""
    failures = {0: _failure(0, 1, 100, tmp_path), 1: _failure(1, -int(signal.SIGKILL), 100, tmp_path)}
    said = _launcher_says(failures, tmp_path, monkeypatch)
    assert said.startswith("rank 1 of 2 failed first (killed by SIGKILL)"), said


def test_the_rank_whose_error_came_first_is_named_when_both_exit_in_the_same_second(tmp_path, monkeypatch):
    """Rank 1 raises an error of its own (no UserError); rank 0's collective then loses it and rank 0 fails too,
    both seen by torchrun in the same second: the launcher names rank 1, and rank 0 ends without its echo."""
    def crashing_train(_args, _overrides):
        raise RuntimeError("rank 1's own error")

    monkeypatch.setattr(cli, "_cmd_train", crashing_train)
    monkeypatch.setenv(relaunch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="rank 1's own error"):  # (its traceback is printed, as before)
        cli.main(["train"])

    exits = []

    def exit_now(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(cli.os, "_exit", exit_now)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):  # rank 0's error is the consequence: no second traceback
        cli.main(["train"])
    assert exits == [1]

    failures = {0: _failure(0, 1, 100, tmp_path), 1: _failure(1, 1, 100, tmp_path)}
    said = _launcher_says(failures, tmp_path, monkeypatch)
    assert said.startswith("rank 1 of 2 failed first (exit code 1)"), said
