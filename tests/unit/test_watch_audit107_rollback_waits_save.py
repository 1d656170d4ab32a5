"""A rollback first waits for the asynchronous save in flight (read_back.roll_back_trainer), in the phase "load", which
the hang watchdog does not time outside a collective: a save stuck in I/O (a dead file system under every rank) hung
the job there for ever, with no record and no exit, where the same wait at the next save (phase "save") ends with
exit 86 and says where each rank was. The wait is timed as a save's now."""

import json
import time
from types import SimpleNamespace

import pytest

from longctx.job import watchdog
from longctx.train.read_back import roll_back_trainer
from longctx.train.rollback import BadStep


class _Cut(Exception):
    """Ends the test's stuck wait (the rollback itself is not what is tested)."""


def _stuck_save_in_flight():
    time.sleep(1.5)  # the async save's writes stopped: 3x timeout_s
    raise _Cut


def test_a_stuck_save_in_flight_at_a_rollback_is_a_hang(tmp_path):
    trainer = SimpleNamespace(saves=SimpleNamespace(wait=_stuck_save_in_flight))
    w = watchdog.Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        with pytest.raises(_Cut):
            roll_back_trainer(trainer, BadStep(7, "the training loss is nan", {}), None)
    finally:
        w.stop()
    assert w.fired.is_set()
    record = json.loads((tmp_path / "hang0.json").read_text())
    assert (record["step"], record["phase"], record["collective"]) == (7, "save", None)
