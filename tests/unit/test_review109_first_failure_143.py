"""`longctx eval --nproc N`: a rank torchrun stops with SIGTERM after another failed now exits 143 (eval/stopped.py
Terminated keeps the finished lengths) where the signal's default action ended it (-15). torchrun records the ranks
it stopped among the failures (elastic api.py _poll, "for bookkeeping"), and the launcher ranked an exit of 143 as
an error of the rank's own: in the same second as the failing rank's exit, rank 0 was named as the first failure
("rank 0 of 2 failed first (exit code 143)")."""

from __future__ import annotations

import pytest
from test_launch_audit_first_failure import _failure, _launcher_says


@pytest.mark.parametrize("stopped", [143, 130])  # (SIGTERM's, SIGINT's: 128 + the signal)
def test_a_rank_that_stopped_on_the_launchers_signal_is_not_named_as_the_first_failure(tmp_path, monkeypatch,
                                                                                       stopped):
    failures = {0: _failure(0, stopped, 100, tmp_path), 1: _failure(1, 1, 100, tmp_path)}
    said = _launcher_says(failures, tmp_path, monkeypatch)
    assert said.startswith("rank 1 of 2 failed first (exit code 1)"), said
