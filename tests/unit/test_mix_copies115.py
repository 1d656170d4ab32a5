"""A resume on an edited mix (--checkpoint.allow_changes: other weights, a store added or dropped) goes on from each
store's own count, also for a store and its copy at another path, which share one identity (data/store_mix.py
continue_from, _own_counts). Taken by identity, the two counts were one (the later store's): both copies went on from
it, one repeating samples it had given in its epoch and skipping others."""

import shutil

import pytest

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader

CURSOR = 1_577
WEIGHTS = (0.3, 0.5, 0.2)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("copies115")
    a, b, c = letter_store(tmp, "a", 30), letter_store(tmp, "b", 20), letter_store(tmp, "c", 10)
    copy = tmp / "copy_of_a"
    shutil.copytree(a, copy)
    # a rebuilt with other content (another folder, the same name "a": a store rebuilt in place, as the mix names it)
    rebuilt = letter_store(tmp / "rebuilt", "a", 30, seed=99)
    return {"a": a, "copy": copy, "b": b, "c": c, "rebuilt_a": rebuilt}


def _position(stores, names, weights=WEIGHTS, cursor=CURSOR):
    """(the mix of `names` at `weights` read through `cursor`, its data position there, each store's count there)."""
    mix = store_mix([stores[n] for n in names], weights)
    loader = BatchLoader(mix, 4, seed=0)
    loader.order.load_state_dict({"cursor": cursor})
    position = loader.state_dict()
    counts = dict(zip(names, (int(n) for _, n in position["mix"]["given"])))
    assert mix.stores[0].identity["identity"] == mix.stores[1].identity["identity"]  # (a and its copy: one)
    assert counts["a"] != counts["copy"]  # (the case at issue: the two had given different counts)
    return mix, position, counts


def _resumed(stores, names, weights, position):
    loader = BatchLoader(store_mix([stores[n] for n in names], weights), 4, seed=0)
    note = loader.load_state_dict(position, allow_changes=True)
    return loader.samples, note


def _per_store(mix, first: int, n: int) -> dict[int, list[int]]:
    """Each store's samples in the order the blend draws them, over blend positions first .. first + n - 1."""
    out: dict[int, list[int]] = {}
    for k in range(first, first + n):
        s, j = mix.locate(k)
        out.setdefault(s, []).append(j)
    return out


def test_other_weights_each_copy_goes_on_with_its_own_samples(stores):
    """Each store draws, after the resume, the samples the run that never stopped would have drawn next from it
    (a store's sequence of samples is its own permutations read on from its count, whatever the weights)."""
    names = ["a", "copy", "b"]
    through, position, counts = _position(stores, names)
    resumed, note = _resumed(stores, names, (0.2, 0.2, 0.6), position)
    assert resumed.blend_position(CURSOR)["given"] == position["mix"]["given"]
    after, want = _per_store(resumed, CURSOR, 300), _per_store(through, CURSOR, 900)
    for s in range(3):
        assert after[s] == want[s][:len(after[s])], names[s]
    assert f"a at sample {counts['a']:,}" in note and f"copy_of_a at sample {counts['copy']:,}" in note


def test_a_store_added_leaves_each_copy_its_count(stores):
    names = ["a", "copy", "b"]
    _, position, counts = _position(stores, names)
    resumed, note = _resumed(stores, [*names, "c"], (0.3, 0.3, 0.2, 0.2), position)
    given = [int(n) for _, n in resumed.blend_position(CURSOR)["given"]]
    assert given == [counts["a"], counts["copy"], counts["b"], 0]
    assert "c at sample 0 (new)" in note


def test_the_first_copy_dropped_leaves_the_other_its_own_count(stores):
    """The copy moves to the mix's first place: matched by its name, not by its place among the stores of its
    identity (which would give it a's count)."""
    _, position, counts = _position(stores, ["a", "copy", "b"])
    resumed, _ = _resumed(stores, ["copy", "b"], (0.5, 0.5), position)
    assert [int(n) for _, n in resumed.blend_position(CURSOR)["given"]] == [counts["copy"], counts["b"]]


def test_a_copy_added_starts_at_its_first_sample(stores):
    """A copy the position does not record has given nothing yet (it took its original's count before)."""
    mix = store_mix([stores["a"], stores["b"]], (0.6, 0.4))
    loader = BatchLoader(mix, 4, seed=0)
    loader.order.load_state_dict({"cursor": CURSOR})
    position = loader.state_dict()
    was = {name: int(n) for name, (_, n) in zip(("a", "b"), position["mix"]["given"])}
    resumed, note = _resumed(stores, ["a", "b", "copy"], (0.4, 0.4, 0.2), position)
    assert [int(n) for _, n in resumed.blend_position(CURSOR)["given"]] == [was["a"], was["b"], 0]
    assert "copy_of_a at sample 0 (new)" in note


def test_a_position_saved_before_names_were_recorded_reads_copies_in_the_mix_order(stores):
    names = ["a", "copy", "b"]
    _, position, counts = _position(stores, names)
    del position["mix"]["names"]
    resumed, _ = _resumed(stores, names, (0.2, 0.2, 0.6), position)
    assert [int(n) for _, n in resumed.blend_position(CURSOR)["given"]] == [counts[n] for n in names]


def test_a_store_rebuilt_beside_its_copy_goes_on_from_its_count(stores):
    """a rebuilt in place (another identity, the same name) while its copy stays: it goes on from a's count, as a
    store rebuilt in place does (before, a's entry counted as the copy's identity's, and the rebuilt a was new)."""
    _, position, counts = _position(stores, ["a", "copy", "b"])
    resumed, note = _resumed(stores, ["rebuilt_a", "copy", "b"], WEIGHTS, position)
    assert resumed.stores[0].identity["identity"] != resumed.stores[1].identity["identity"]
    assert [int(n) for _, n in resumed.blend_position(CURSOR)["given"]] == [counts["a"], counts["copy"], counts["b"]]
    assert f"a at sample {counts['a']:,} (rebuilt)" in note
