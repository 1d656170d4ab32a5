"""The hang watchdog after a save: a rank counts as waiting while it is in a save (job/watchdog.py: a save stuck in
I/O waits in no collective), and the save's phase stayed on once RunSaves.save had returned, through the rest of the
step (metrics, the signal exchange) and the next step's entry into its stage, up to that step's data phase. A new stage
opened after a save step (stage ends and checkpoint.interval often fall together: a larger store opened, its samples'
costs computed) is a rank computing, waiting for nobody (docs/running.md: nothing fires), yet one longer than
parallel.timeout_s ended every rank with exit 86 as hung "in save" after the save was committed."""

import json
import time
from types import SimpleNamespace

from longctx.job import watchdog
from longctx.train.saves import RunSaves


class _Saved:
    """A checkpoint manager whose saves return at once (committed)."""

    def save(self, *_args):
        pass

    def wait(self):
        pass


def _cfg():
    return SimpleNamespace(checkpoint=SimpleNamespace(interval=2, final=True, on_save_error="stop"),
                           train=SimpleNamespace(steps=10))


def test_a_rank_computing_after_a_save_returned_is_not_hung(tmp_path):
    w = watchdog.Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(2, "optimizer")
        RunSaves(_Saved(), _cfg()).save(2, None, None, SimpleNamespace(state_dict=dict))
        time.sleep(1.5)  # after the save: entering the next stage, computing (no collective), 3x timeout_s
    finally:
        w.stop()
    assert not w.fired.is_set() and not (tmp_path / "hang0.json").exists()
    assert (w.step, w.phase) == (2, "optimizer")  # where the rank is: after step 2's update, no longer saving


def test_a_save_that_does_not_return_still_fires(tmp_path):
    class Stuck(_Saved):
        def save(self, *_args):
            time.sleep(1.5)  # the save's I/O stuck (a dead file system): in no collective

    w = watchdog.Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        RunSaves(Stuck(), _cfg()).save(2, None, None, SimpleNamespace(state_dict=dict))
    finally:
        w.stop()
    assert w.fired.is_set() and json.loads((tmp_path / "hang0.json").read_text())["phase"] == "save"
