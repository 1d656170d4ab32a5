"""step/co2.py's schedule (OuterSync.step_done): every round end's change is merged `overlap` steps
later, whatever step the rounds are resumed at and whatever they were before (a checkpoint without CO2
state, or one written with another round length), and no change in flight is ever sent over."""

import pytest

from longctx.step.co2 import OuterSync


class Recorder(OuterSync):
    """OuterSync's schedule with its collectives replaced by a log of what it would do."""

    def __init__(self, local_steps: int, overlap: int, in_flight: bool = False):  # (no parameters, no mesh)
        self.local_steps, self.overlap = local_steps, overlap or local_steps
        self.pending, self.arrived, self.rounds, self.k = None, "resumed" if in_flight else None, 0, 0
        self.events: list[tuple[str, int]] = []

    def merge(self, keep=None) -> None:
        if self.pending is not None or self.arrived is not None:
            self.events.append(("merge", self.k))
            self.pending = self.arrived = None

    def end_round(self) -> None:
        assert self.pending is None and self.arrived is None, f"a change still in flight at step {self.k}"
        self.events.append(("send", self.k))
        self.pending = "sent"
        self.rounds += 1


@pytest.mark.parametrize("local_steps", [1, 2, 3, 4])
@pytest.mark.parametrize("first", [1, 2, 5, 7])  # the step the rounds resume at
@pytest.mark.parametrize("rounds_before", [0, 3])  # the restored round count (a checkpoint's, any length)
def test_every_send_is_merged_overlap_steps_later(local_steps, first, rounds_before):
    for overlap in range(1, local_steps + 1):
        outer = Recorder(local_steps, overlap, in_flight=rounds_before > 0)
        outer.rounds = rounds_before
        for k in range(first, first + 6 * local_steps):
            outer.k = k
            outer.step_done(k)
        sends = [k for what, k in outer.events if what == "send"]
        merges = [k for what, k in outer.events if what == "merge"]
        assert sends == [k for k in range(first, first + 6 * local_steps) if k % local_steps == 0]
        expected = [k + overlap for k in sends if k + overlap < first + 6 * local_steps]
        if rounds_before:  # the checkpoint's change in flight: merged at the first merge point or round end
            expected = [next(k for k in range(first, first + 2 * local_steps) if k % local_steps == 0 or (
                (k - overlap) % local_steps == 0 and k >= overlap))] + expected
        assert merges == expected, (overlap, outer.events)
