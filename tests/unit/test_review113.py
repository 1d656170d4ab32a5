"""Review of the progress counts inside long work (checkpoint reads, training steps, generation).

1. eval --mode generate's length phase follows its batch's prefill (Phase.follow) while the working thread assigns
   the count itself (a new token, the batch made whole). A heartbeat line read the count, asked the source, then
   wrote the larger back: a batch made whole in between was put back to its prefill's share, and the next batch
   took that as its base, so the length ended short of its sequences (e.g. 1.5/2 after the last batch).
"""

from __future__ import annotations

import threading
import time

from longctx.eval.generate_count import SequenceCount
from longctx.progress import Phase


class _HeldPrefill(Phase):
    """A prefill phase whose part a line reads: it holds that line (the heartbeat's thread) inside the
    length's source until released, as the GIL may between its read of the count and its write."""

    def __init__(self, reading: threading.Event, release: threading.Event):
        super().__init__("prefill", total=20, unit="prompt tokens")
        self.done = 10
        self.reading, self.release = reading, release

    def part(self) -> float:
        self.reading.set()
        assert self.release.wait(10)
        return super().part()


def test_a_line_said_while_a_batch_ends_does_not_put_the_lengths_count_back():
    length = Phase("512 tokens", total=4, unit="sequences")
    count = SequenceCount(length)  # (no cfg: a prefill is half of a sequence)
    count.begin([10, 10], [4, 4])
    reading, release = threading.Event(), threading.Event()
    length.inner(_HeldPrefill(reading, release))  # (the heartbeat's watch_inner call as the prefill begins)
    release.set()
    assert "0.5/4 sequences" in length.describe(time.monotonic())  # (followed: the prefill's half of 2 sequences)
    assert length.done == 0.5  # (the count as the line said it)
    reading.clear(), release.clear()
    line = []
    heartbeat = threading.Thread(target=lambda: line.append(length.describe(time.monotonic())))
    heartbeat.start()
    try:
        assert reading.wait(10)
        count.end()  # the batch's 2 sequences whole, while the line is being said
    finally:
        release.set()
        heartbeat.join(10)
    assert line, "the line was not said"
    assert length.done == 2, length.done  # was 0.5: the line's stale count written over the batch's end
    count.begin([10, 10], [4, 4])
    count.end()
    assert length.done == 4, length.done  # the length whole at its end
