"""co2_exposed_s on the metrics line (step/co2.py OuterSync.exposed_s): how long the last wait for an
outer all-reduce took. A checkpoint's save receives the change in flight (finish) before its merge; that
wait was not timed, and the merge after it, finding the change already there, left the figure of the
merge before: one merge's wait reported twice and the save's never. A fake clock, advanced by the waits."""

from longctx.step import co2


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Transfer:
    """An all-reduce in flight whose wait takes `seconds` of the fake clock."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def wait(self):
        self.clock.now += self.seconds
        return "summed"


class _Outer(co2.OuterSync):
    def __init__(self):  # (no parameters, no mesh: only the receiving side)
        self.pending = self.arrived = None
        self.exposed_s = 0.0


def test_the_exposed_time_is_the_last_waits_even_when_a_save_received_it(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(co2, "time", clock)
    outer = _Outer()
    outer.pending = _Transfer(clock, 3.0)
    assert outer._receive() == "summed" and outer.exposed_s == 3.0  # a merge that waited 3 s
    outer.pending = _Transfer(clock, 0.5)
    outer.finish()  # a checkpoint's save receives the next change, waiting 0.5 s
    assert outer._receive() == "summed"  # its merge: nothing left to wait for
    assert outer.exposed_s == 0.5
    assert outer._receive() is None and outer.exposed_s == 0.5  # nothing in flight: unchanged
