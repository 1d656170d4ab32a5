"""A resume on an edited mix goes on with each store's own order: a store's permutations are drawn from a key it
keeps across edits (data/store_mix.py `keys`), not from its place in the mix. Drawn from its place, a store that
moved (an earlier store dropped, the stores listed in another order) went on from its count in another
permutation of its epoch: samples it had given came again and others were skipped, under a note saying it went on
from its own place."""

import pytest

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader

CURSOR = 1_201
NAMES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys115")
    return {"a": letter_store(tmp, "a", 30), "b": letter_store(tmp, "b", 20), "c": letter_store(tmp, "c", 10)}


def _loader(stores, names, weights):
    return BatchLoader(store_mix([stores[n] for n in names], weights), 4, seed=0)


def _per_store(mix, names, first: int, n: int) -> dict[str, list[int]]:
    """Each store's samples (by name) in the order the blend draws them over blend positions first .. first + n - 1."""
    out: dict[str, list[int]] = {}
    for k in range(first, first + n):
        s, j = mix.locate(k)
        out.setdefault(names[s], []).append(j)
    return out


def _resume(stores, names, weights, position):
    loader = _loader(stores, names, weights)
    loader.load_state_dict(position, allow_changes=True)
    return loader.samples


def _check_goes_on(through, resumed, names):
    after = _per_store(resumed.samples if hasattr(resumed, "samples") else resumed, names, CURSOR, 400)
    want = _per_store(through, NAMES, CURSOR, 2_000)
    for name in names:
        assert after[name] == want[name][:len(after[name])], name


@pytest.mark.parametrize("names,weights", [
    (["b", "c"], (0.5, 0.5)),  # a dropped: b and c each move up a place
    (["c", "b", "a"], (0.2, 0.5, 0.3)),  # the same stores listed in another order, other weights
    (["c", "a"], (0.5, 0.5)),  # b dropped, the rest reordered
])
def test_a_store_that_moves_goes_on_in_its_own_order(stores, names, weights):
    loader = _loader(stores, NAMES, (0.3, 0.5, 0.2))
    loader.order.load_state_dict({"cursor": CURSOR})
    position = loader.state_dict()
    resumed = _resume(stores, names, weights, position)
    _check_goes_on(loader.samples, resumed, names)


def test_the_keys_last_over_two_edits_and_a_store_added_takes_a_free_one(stores):
    """a dropped, then added back later (at the end): b and c keep their orders over both resumes; a starts at its
    first sample (a store dropped and added back restarts: the position keeps only the mix's own stores) in an
    order of its own, not b's or c's."""
    first = _loader(stores, NAMES, (0.3, 0.5, 0.2))
    first.order.load_state_dict({"cursor": CURSOR})
    middle = _resume(stores, ["b", "c"], (0.5, 0.5), first.state_dict())
    at = CURSOR + 300
    two = BatchLoader(middle, 4, seed=0)
    two.order.load_state_dict({**two.state_dict(), "cursor": at})
    position = two.state_dict()
    last = _resume(stores, ["c", "b", "a"], (0.4, 0.4, 0.2), position)
    after, want = _per_store(last, ["c", "b", "a"], at, 400), _per_store(middle, ["b", "c"], at, 2_000)
    for name in ("b", "c"):
        assert after[name] == want[name][:len(after[name])], name
    keys = last.blend_position(at)["keys"]
    assert len(set(keys)) == 3, keys  # (a's permutations are its own: no key shared with a store of the mix)


def test_a_mix_never_edited_draws_as_before(stores):
    """The keys of a fresh mix are the stores' places: every run's order is what it was (checked against the
    permutation drawn from the place itself)."""
    import numpy as np

    mix = store_mix([stores[n] for n in NAMES], (0.3, 0.5, 0.2))
    for s in range(3):
        want = np.random.default_rng([0, 0x4D4958, s, 0]).permutation(len(mix.stores[s]))
        assert (mix._permutation(s, 0) == want).all()


def test_a_record_it_cannot_read_leaves_the_keys_as_they_were(stores):
    """continue_from reads everything of the record before the mix changes: one without its counts at the cursor
    (damaged) raises and the mix draws on as before, its keys included."""
    mix = store_mix([stores[n] for n in NAMES], (0.3, 0.5, 0.2))
    record = mix.blend_position(CURSOR)
    before = _per_store(mix, NAMES, CURSOR, 200)
    damaged = {k: v for k, v in record.items() if k != "given"} | {"keys": [2, 0, 1]}
    with pytest.raises(KeyError):
        mix.continue_from(CURSOR, damaged, same=True)
    assert mix.blend_position(CURSOR)["keys"] == [0, 1, 2]
    assert _per_store(mix, NAMES, CURSOR, 200) == before
