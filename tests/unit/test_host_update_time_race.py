"""step/host_optimizer.py _Updates: the update's time is written before its last unit reads as ready, so a
forward that has waited for every unit reads this update's time (host_step_s on the metrics line), not the
previous update's. A slow Event.set() on the last unit widens the window the old order left open."""

import threading
import time

from longctx.step.host_optimizer import _Updates


class _SlowSet(threading.Event):
    def set(self):
        super().set()
        time.sleep(0.2)  # the waiter runs before the worker goes on


def test_a_forward_that_waited_for_every_unit_reads_this_updates_time():
    updates = _Updates(3)
    updates.start(lambda k: None)  # a first, instant update: its time is ~0
    updates.finish()
    slow = _SlowSet()
    threading.Event.set(slow)  # (set, as a unit with no update in flight is)
    updates.ready[-1] = slow
    updates.start(lambda k: time.sleep(0.1))  # the second: ~0.3 s
    for k in range(3):
        updates.wait(k)
    seen = updates.step_s
    updates.finish()
    assert seen >= 0.3, seen  # the old order gave the first update's ~0 s here
    assert updates.exposed_s >= 0
