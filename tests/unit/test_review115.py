"""Review of the edited-mix resumes (data/store_mix.py keys and counts): a later stage of the same length goes on with
the mix's position, not with its cursor alone (train/stages.py StagedLoader).

A mix's stores all hold samples of one length, so a run that changes its batch by stages (`64:3:4,64:3:8`) reads the
same stores in every stage, each stage with a loader of its own. A stage entered at its first step went on from the
cursor where the stage before left the store, read in a mix built afresh: its schedule from blend position 0 under
its weights, each store's permutations drawn from its place. After a resume on an edited mix (a store dropped, the
stores listed in another order, other weights: --checkpoint.allow_changes), that mix goes on from each store's own
count in the permutation of its own key (data/store_mix.py continue_from), so the next stage gave each store another
count (about its weight x the cursor) and another permutation: samples drawn before came again, others were skipped.
A checkpoint at a stage's last step, resumed on an edited mix, did not even say the data had changed (the position
was applied to its own stage only: the next stage took its cursor alone, with no check of the store it was saved on).
"""

from __future__ import annotations

import pytest

from letter_stores import letter_store, store_mix
from longctx.config import load_config
from longctx.data.loader import BatchLoader, PackedSamples
from longctx.errors import DataError
from longctx.train.stages import StagedLoader

STAGES = "64:3:4,64:3:8"  # one length, the batch doubled from step 4
BATCH = {1: 4, 2: 4, 3: 4, 4: 8, 5: 8, 6: 8}
FIRST_MIX = (["a", "b", "c"], (0.3, 0.5, 0.2))
EDITED_MIX = (["c", "b"], (0.5, 0.5))  # a dropped, b and c listed the other way round


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review115")
    # (one document a sample: 60, 50 and 40 samples, more than any store is drawn here: no epoch ends)
    return {name: letter_store(tmp, name, n) for name, n in (("a", 60), ("b", 50), ("c", 40))}


def _staged(stores, mix, allow_changes: bool = False, stages: str = STAGES) -> StagedLoader:
    names, weights = mix
    cfg = load_config(None, [f"--train.stages={stages}", "--train.eval_interval=0",
                             f"--checkpoint.allow_changes={str(allow_changes).lower()}"])

    def read(samples, indices):  # (each row as its store's name and its sample there)
        return [(names[s], j) for s, j in (samples.locate(int(k)) for k in indices)], len(indices)

    return StagedLoader(cfg, lambda c: (store_mix([stores[n] for n in names], weights), None), dp=1, read_local=read)


def _steps(loader: StagedLoader, steps) -> dict[int, list]:
    out = {}
    for step in steps:
        loader.enter(step)
        out[step] = [row for share, _ in loader.step_batches(step) for row in share]
    return out


def _unstaged(stores, mix, position: dict, steps) -> dict[int, list]:
    """The reference: one loader on the edited mix, resumed at `position`, drawing every step's rows in turn (a
    batch change moves no cursor: the blend simply goes on)."""
    names, weights = mix
    loader = BatchLoader(store_mix([stores[n] for n in names], weights), 1, seed=0)
    loader.load_state_dict(position, allow_changes=True)
    return {step: _rows(loader, names, BATCH[step]) for step in steps}


def _rows(loader: BatchLoader, names: list[str], n: int) -> list:
    """The loader's next `n` rows, each as its store's name and its sample there."""
    return [(names[s], j) for s, j in (loader.samples.locate(k) for k in loader.order.next_indices(n))]


def _no_sample_twice(*runs: dict[int, list]) -> None:
    """No store's sample is drawn twice (no store reaches the end of its first epoch here)."""
    rows = [row for run in runs for step in sorted(run) for row in run[step]]
    twice = sorted({row for row in rows if rows.count(row) > 1})
    assert not twice, f"drawn twice: {twice}"


@pytest.mark.parametrize("saved_at", [2, 3])  # inside stage 1, and at its last step
def test_the_next_stage_of_one_length_goes_on_with_an_edited_mix_as_it_was_resumed(stores, saved_at):
    first = _staged(stores, FIRST_MIX)
    before = _steps(first, range(1, saved_at + 1))
    position = first.state_dict()
    resumed = _staged(stores, EDITED_MIX, allow_changes=True)
    resumed.load_state_dict(position)
    after = _steps(resumed, range(saved_at + 1, 7))
    want = _unstaged(stores, EDITED_MIX, position, range(saved_at + 1, 7))
    for step in after:
        assert after[step] == want[step], f"step {step} (stage {1 + (step > 3)})"
    _no_sample_twice(before, after)


def test_a_checkpoint_at_a_stages_end_resumed_on_an_edited_mix_says_so(stores):
    first = _staged(stores, FIRST_MIX)
    drawn = [name for rows in _steps(first, range(1, 4)).values() for name, _ in rows]
    resumed = _staged(stores, EDITED_MIX, allow_changes=True)
    resumed.load_state_dict(first.state_dict())
    resumed.enter(4)
    note = resumed.position_note or ""
    counts = f"c at sample {drawn.count('c')}, b at sample {drawn.count('b')}"
    assert f"each store goes on from its own place ({counts})" in note, note


def test_a_checkpoint_at_a_stages_end_on_a_store_rebuilt_is_refused_as_inside_a_stage(stores, tmp_path):
    """One store, rebuilt in place with other content between the save and the resume: refused (unless
    --checkpoint.allow_changes), at a stage's end as inside it, not read from the same cursor without a word."""
    built = letter_store(tmp_path, "x", 30)

    def staged(allow_changes=False):
        cfg = load_config(None, [f"--train.stages={STAGES}", "--train.eval_interval=0",
                                 f"--checkpoint.allow_changes={str(allow_changes).lower()}"])
        return StagedLoader(cfg, lambda c: (PackedSamples(str(built)), None), dp=1,
                            read_local=lambda samples, idx: (list(idx), len(idx)))

    first = staged()
    _steps(first, range(1, 4))
    position = first.state_dict()
    position["store"] = {**position["store"], "identity": "0123456789abcdef"}  # (saved on another build)
    resumed = staged()
    resumed.load_state_dict(position)
    with pytest.raises(DataError, match="rebuilt with other content"):
        resumed.enter(4)
    allowed = staged(allow_changes=True)
    allowed.load_state_dict(position)
    allowed.enter(4)
    assert "continuing on the new data from the same cursor" in (allowed.position_note or "")
    assert allowed.loader.order.cursor == 12  # (the same cursor: steps 1-3 of 4)


def test_a_stage_of_one_length_entered_in_the_run_goes_on_as_one_loader(stores):
    """No resume: the stages of one length read the blend as one loader without stages does."""
    run = _steps(_staged(stores, FIRST_MIX), range(1, 7))
    names, weights = FIRST_MIX
    loader = BatchLoader(store_mix([stores[n] for n in names], weights), 1, seed=0)
    for step in range(1, 7):
        assert run[step] == _rows(loader, names, BATCH[step]), step
