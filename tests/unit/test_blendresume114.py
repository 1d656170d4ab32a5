"""A resume on the same mix goes on with the blend's schedule from the counts its data position recorded, without
computing the positions before it: the chairman assignment at a position depends only on the position and each
store's count there (data/store_mix.py). Before, a resume at blend position k recomputed the whole schedule up to
k in Python, ~47 s and ~160 MB per rank at 1e7. The samples drawn after the resume, and after a rollback to before
it, are those of the run that never stopped."""

import numpy as np
import pytest

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader
from longctx.data.store_mix import StoreMix

CURSOR = 60_000


def _mix(stores, weights=(0.5, 0.3, 0.2)) -> StoreMix:
    return store_mix(stores, weights)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blendresume")
    return [letter_store(tmp, letter, n) for letter, n in (("a", 30), ("b", 20), ("c", 10))]


def _drawn(mix: StoreMix, first: int, n: int) -> list[tuple[int, int]]:
    return [mix.locate(k) for k in range(first, first + n)]


def test_a_resume_goes_on_from_the_recorded_counts_without_the_past(stores, monkeypatch):
    import longctx.data.store_mix as store_mix

    through = _mix(stores)
    want = _drawn(through, CURSOR, 500)
    saved = BatchLoader(through, 4, seed=0)
    saved.order.load_state_dict({"cursor": CURSOR})
    position = saved.state_dict()

    scheduled = []
    schedule = store_mix.blend_schedule
    monkeypatch.setattr(store_mix, "blend_schedule", lambda w, c, first, n: scheduled.append((first, n))
                        or schedule(w, c, first, n))
    resumed = BatchLoader(_mix(stores), 4, seed=0)
    resumed.load_state_dict(position)
    assert _drawn(resumed.samples, CURSOR, 500) == want
    assert min(first for first, _ in scheduled) == CURSOR, scheduled  # (nothing before the resume computed)
    again = resumed.samples.blend_position(CURSOR + 500)
    assert again["given"] == through.blend_position(CURSOR + 500)["given"]


def test_a_rollback_to_before_the_resume_draws_what_the_run_drew(stores):
    through = _mix(stores)
    saved = BatchLoader(through, 4, seed=0)
    saved.order.load_state_dict({"cursor": CURSOR})
    position = saved.state_dict()
    resumed = BatchLoader(_mix(stores), 4, seed=0)
    resumed.load_state_dict(position)
    earlier = CURSOR - 40
    assert _drawn(resumed.samples, earlier, 80) == _drawn(through, earlier, 80)
    counts = np.bincount(np.asarray([s for s, _ in _drawn(_mix(stores), 0, earlier)]), minlength=3)
    assert resumed.samples.blend_position(earlier)["given"] == [
        [store.identity["identity"], int(n)] for store, n in zip(resumed.samples.stores, counts)]


def test_a_rollback_position_before_the_resume_goes_on_from_its_own_counts(stores, monkeypatch):
    """A rollback (or a resume) to a position before where this process's schedule starts goes on from the counts
    that position recorded, not from blend position 0 again."""
    import longctx.data.store_mix as store_mix

    through = _mix(stores)
    positions = {}
    for cursor in (CURSOR - 400, CURSOR):
        saved = BatchLoader(through, 4, seed=0)
        saved.order.load_state_dict({"cursor": cursor})
        positions[cursor] = saved.state_dict()
    resumed = BatchLoader(_mix(stores), 4, seed=0)
    resumed.load_state_dict(positions[CURSOR])
    _drawn(resumed.samples, CURSOR, 8)  # (steps after the resume: the schedule is known from CURSOR on)
    scheduled = []
    schedule = store_mix.blend_schedule
    monkeypatch.setattr(store_mix, "blend_schedule", lambda w, c, first, n: scheduled.append(first)
                        or schedule(w, c, first, n))
    resumed.load_state_dict(positions[CURSOR - 400])
    assert _drawn(resumed.samples, CURSOR - 400, 800) == _drawn(through, CURSOR - 400, 800)
    assert min(scheduled) == CURSOR - 400, scheduled
