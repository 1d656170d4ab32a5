"""A data position that BatchLoader.load_state_dict refuses leaves the loader as it was: every check (the store's
identity, its packing, the seed) runs before anything changes. Before, a mix's schedule was taken up from the
position (data/store_mix.py continue_from) before the packing and seed checks could still refuse it, so a caller that
caught the error read on from another schedule: here, one that starts where the refused position's did, so the next
batch was an IndexError."""

import dataclasses

import pytest
import torch

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader
from longctx.errors import DataError

SAVED_AT = 120  # where the edited mix's run resumed: its positions' schedule starts there


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refusal115")
    return [letter_store(tmp, letter, n) for letter, n in (("a", 12), ("b", 8))]


def _loader(stores, weights=(0.6, 0.4)) -> BatchLoader:
    return BatchLoader(store_mix(stores, weights), 4, seed=0)


def _edited_position(stores) -> dict:
    """A position of a run that resumed on an edited mix (other weights) at blend position SAVED_AT and drew two
    batches: its record's schedule starts at SAVED_AT, not at 0."""
    first = _loader(stores, (0.3, 0.7))
    first.order.load_state_dict({"cursor": SAVED_AT})
    run = _loader(stores)
    run.load_state_dict(first.state_dict(), allow_changes=True)
    run.next_batch(), run.next_batch()
    position = run.state_dict()
    assert position["mix"]["from"] == SAVED_AT  # (the case at issue)
    return position


def _batches(loader: BatchLoader, n: int) -> list[list[torch.Tensor]]:
    return [[t for t in dataclasses.astuple(loader.next_batch()) if isinstance(t, torch.Tensor)] for _ in range(n)]


def _same(got, want) -> bool:
    return len(got) == len(want) and all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                                         for a, b in zip(got, want))


@pytest.mark.parametrize("refused", ["seed", "packing", "store"])
def test_a_refused_position_leaves_the_loader_reading_on_as_before(stores, refused):
    position = _edited_position(stores)
    if refused == "seed":
        position["seed"] = 7
    elif refused == "packing":  # (the same documents packed into other samples: refused without allow_changes)
        position["store"] = {**position["store"], "layout": "another-layout"}
    else:  # (another store's position: refused before, and still)
        position["store"] = {**position["store"], "identity": "0" * 16}
    untouched, loader = _loader(stores), _loader(stores)
    assert _same(_batches(loader, 3), _batches(untouched, 3))  # (a run three batches in)
    with pytest.raises(DataError):
        loader.load_state_dict(position)
    assert loader.order.cursor == untouched.order.cursor == 12
    assert _same(_batches(loader, 40), _batches(untouched, 40))  # (past the refused schedule's start, 120)


def test_a_position_taken_after_a_refused_one_is_read_as_on_a_fresh_loader(stores):
    position = _edited_position(stores)
    wrong = {**position, "seed": 7}
    fresh, loader = _loader(stores), _loader(stores)
    with pytest.raises(DataError):
        loader.load_state_dict(wrong)
    assert loader.load_state_dict(position) == fresh.load_state_dict(position)
    assert _same(_batches(loader, 10), _batches(fresh, 10))
    assert loader.state_dict() == fresh.state_dict()
