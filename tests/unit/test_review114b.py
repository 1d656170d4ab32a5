"""Review of the resume records of 81f2909f (a mix's per-store counts, data/store_mix.py blend_position) and of the
flag checks of 279ee520 / 6b5bf508."""

import json
import shutil

import numpy as np
import pytest

from letter_stores import letter_store, store_mix
from longctx.data.loader import BatchLoader


@pytest.fixture(scope="module")
def mix_loader(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review114b")
    stores = [letter_store(tmp, "a", 12), letter_store(tmp, "b", 8)]
    mix = store_mix(stores, [0.7, 0.3])
    return BatchLoader(mix, 4, seed=0)


def test_a_rollbacks_mix_position_counts_the_steps_rolled_back_not_the_run(mix_loader, monkeypatch):
    """Each step's position records each store's count (blend_position, taken every step under a rollback or
    read-ahead). After a rollback of two batches at blend position 40,000, the counts are those of the schedule
    up to the rolled-back position, found by taking the 8 positions off (they were counted again from position 0:
    a cost that grew with the run, 40,004 positions here)."""
    loader, mix = mix_loader, mix_loader.samples
    counted = []
    bincount = np.bincount
    monkeypatch.setattr(np, "bincount", lambda x, *a, **k: counted.append(len(x)) or bincount(x, *a, **k))
    for cursor in (40_000, 40_004, 40_008):
        loader.order.load_state_dict({"cursor": cursor})
        loader.state_dict()
    counted.clear()
    loader.order.load_state_dict({"cursor": 40_000})  # (the position after the bad step: two batches back)
    given = dict(loader.state_dict()["mix"]["given"])
    assert sum(counted) <= 8, counted
    choice = mix._choice[:40_000]
    ids = [store.identity["identity"] for store in mix.stores]
    assert given == {ids[0]: int((choice == 0).sum()), ids[1]: int((choice == 1).sum())}


def _bench_moe(*flags: str):
    from longctx.bench.arg_checks import check_bench_args
    from longctx.cli import build_parser

    check_bench_args("moe", build_parser().parse_args(["bench", "moe", *flags]))


@pytest.mark.parametrize("flag", ["--memory-seq-len", "--seq-len"])
def test_bench_moe_takes_one_empty_length_list_the_docs_use_to_skip_a_part(flag):
    """docs/benchmarks.md's dispatch runs give --memory-seq-len '' (timed only); --seq-len '' measures the saved
    bytes only. Each was refused by 6b5bf508 ("names no length"); only both empty measure nothing."""
    _bench_moe(flag, "")


def test_bench_moe_refuses_every_length_list_empty():
    from longctx.errors import UserError

    with pytest.raises(UserError, match="--seq-len '' and --memory-seq-len '' name no length"):
        _bench_moe("--seq-len", "", "--memory-seq-len", "")


def test_a_store_rebuilt_in_a_mix_goes_on_from_its_count_not_from_its_first_sample(tmp_path):
    """A mix of a and b at 50:50 saved after 5 batches of 4 (10 samples each); b rebuilt in place with one
    document more, resumed under --checkpoint.allow_changes: b goes on at its 10th sample, in its new order, as a
    single store rebuilt goes on from the same cursor (it went back to its first sample, called new: the 10 it had
    trained came again)."""
    a, b = letter_store(tmp_path, "a", 30), letter_store(tmp_path, "b", 20)

    def loader():
        return BatchLoader(store_mix([a, b], [0.5, 0.5]), 4, 0)

    old = loader()
    for _ in range(5):
        old.next_indices()
    position = json.loads(json.dumps(old.state_dict()))
    shutil.rmtree(b)
    shutil.rmtree(tmp_path / "in-b")
    letter_store(tmp_path, "b", 21)
    new = loader()
    note = new.load_state_dict(position, allow_changes=True)
    assert "a at sample 10, b at sample 10 (rebuilt)" in note
    drawn = [new.samples.locate(k) for k in new.next_indices()]
    fresh = loader()  # (the rebuilt b's own order: its samples as a run on the new mix from its start draws them)
    b_order = [j for s, j in (fresh.samples.locate(k) for _ in range(8) for k in fresh.next_indices()) if s == 1]
    assert [j for s, j in drawn if s == 1] == b_order[10:10 + sum(s == 1 for s, _ in drawn)]
