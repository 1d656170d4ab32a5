"""A resume on the same mix goes on from the counts its data position recorded (data/store_mix.py
continue_from), store by store in the mix's order: two stores of one identity (a store and its copy at another
path, which data.path does not refuse) are two counts. Taken by identity, both stores went on from one count, and
the samples after the resume were not those of the run that never stopped."""

import shutil

import pytest

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader
from longctx.data.store_mix import StoreMix

CURSOR = 1_577


def _mix(paths, weights=(0.3, 0.5, 0.2)) -> StoreMix:
    return store_mix(paths, weights)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review114c")
    a, b = letter_store(tmp, "a", 30), letter_store(tmp, "b", 20)
    copy = tmp / "copy_of_a"
    shutil.copytree(a, copy)
    return [a, copy, b]


def test_a_store_and_its_copy_resume_from_their_own_counts(stores):
    mix = _mix(stores)
    assert mix.stores[0].identity["identity"] == mix.stores[1].identity["identity"]  # (the case at issue)
    through = BatchLoader(mix, 4, seed=0)
    through.order.load_state_dict({"cursor": CURSOR})
    position = through.state_dict()
    given = [n for _, n in position["mix"]["given"]]
    assert given[0] != given[1]  # (the two stores had given different counts at the cursor)
    want = [mix.locate(k) for k in range(CURSOR, CURSOR + 200)]

    resumed = BatchLoader(_mix(stores), 4, seed=0)
    resumed.load_state_dict(position)
    assert [resumed.samples.locate(k) for k in range(CURSOR, CURSOR + 200)] == want
    assert resumed.state_dict()["mix"]["given"] == position["mix"]["given"]
