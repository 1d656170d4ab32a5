"""Resuming with a changed config (audit resume114): the data a resumed run reads after a legitimate change.

Stages: where a later stage of a length the run already read starts in that length's store.

Two stages of one length share a store (a batch ramp-up, "64:200:8,64:100:16", or a return to a length), and the
later one goes on in its order where the earlier ones left it. That place was computed from the plan (each earlier
stage's steps x its batch), not from what the run drew: a resume that changed an earlier stage's batch
(train.global_batch, or the batch of the stage the run is in, both accepted without --checkpoint.allow_changes)
left the later stage starting elsewhere than where the store's order stood, silently skipping samples (a larger
batch) or training again some it had (a smaller one). The data position now records
where each length's store's order stands, and a stage entered at its first step starts there.

A mix of stores edited on a resume (other weights; --checkpoint.allow_changes): the saved cursor was applied to
the new blend, whose schedule maps it to other counts of each store (count ~ new weight x cursor), so a store
weighed down drew samples it had trained again and one weighed up skipped some. Each store now goes on from
its own count, the new weights applying from the resumed position on.
"""

import json

import pytest

from letter_stores import letter_store, store_mix
from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.data.loader import BatchLoader
from longctx.data.samples import SampleOrder
from longctx.train.stages import StagedLoader
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

STORE = 100  # samples per store: no stage here reaches the end of an epoch


class _Store:
    """A store of STORE samples, never read (the loader only draws indices here)."""

    def __len__(self) -> int:
        return STORE


def _loader(stages: str, batch: int) -> StagedLoader:
    cfg = load_config(None, [f"--train.stages={stages}", f"--train.global_batch={batch}", "--train.eval_interval=0"])
    return StagedLoader(cfg, lambda c: (_Store(), None), dp=1, read_local=lambda samples, idx: (list(idx), len(idx)))


def _steps(loader: StagedLoader, steps) -> dict[int, list[int]]:
    """Each step's samples, as the trainer draws them."""
    out = {}
    for step in steps:
        loader.enter(step)
        out[step] = [i for share, _ in loader.step_batches(step) for i in share]
    return out


def _order(n: int) -> list[int]:
    """The first n samples of a store's order under train.seed 0 (the default)."""
    return SampleOrder(STORE, 0).next_indices(n)


@pytest.mark.parametrize("saved_at", [1, 2])  # inside stage 1, and at its last step
def test_a_later_stage_of_one_length_goes_on_where_the_store_was_left_after_a_batch_change(saved_at):
    """"8:2,16:1,8:2" at batch 2, resumed after step `saved_at` at batch 4: the 8-token store gave stage 1
    2 x saved_at + 4 x (2 - saved_at) samples, and stage 3 goes on from there (its start was put at 2 x 4, as if
    stage 1 had drawn 4 a step: 2 samples skipped, or 4)."""
    first = _loader("8:2,16:1,8:2", batch=2)
    drawn = _steps(first, range(1, saved_at + 1))
    resumed = _loader("8:2,16:1,8:2", batch=4)
    resumed.enter(1)  # (as the trainer builds it, before it knows the checkpoint's step)
    resumed.load_state_dict(first.state_dict())
    drawn.update(_steps(resumed, range(saved_at + 1, 6)))
    of_8 = [i for step in (1, 2, 4, 5) for i in drawn[step]]
    assert of_8 == _order(len(of_8))


QUIET = lambda *a, **k: None  # noqa: E731
BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--metrics.log_interval=1",
        "--train.eval_interval=0", "--train.warmup_steps=1", "--checkpoint.interval=1", "--train.global_batch=2"]


def _recording(trainer: Trainer) -> list:
    drawn, draw = [], trainer.sampler._draw

    def recording():
        drawn.append([i for micro in draw() for i in micro])
        return drawn[-1:]  # (one micro-batch: grad_accum 1)

    trainer.sampler._draw = recording
    return drawn


def test_a_resumed_run_with_another_batch_goes_on_in_the_store_of_its_first_stage(tmp_path):
    """The record travels through a checkpoint (trainer_state.json): "32:2,64:1,32:2" at batch 2, resumed after
    step 1 at batch 4; the 32-token store's samples of steps 1, 2, 4 and 5 are its order's first 14."""
    stages = "--train.stages=32:2,64:1,32:2"
    crashed = Trainer(load_config(None, [*BASE, stages, f"--train.run_dir={tmp_path}"]), log=QUIET)
    before = _recording(crashed)
    run_until_crash(crashed, 2)
    cfg, _ = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path}",
                                    "--train.global_batch=4"], False)
    resumed = Trainer(cfg, log=QUIET)
    assert resumed.start_step == 1
    after = _recording(resumed)
    resumed.run()
    of_32 = before[0] + after[0] + after[2] + after[3]
    assert len(of_32) == 2 + 4 + 4 + 4
    samples = len(resumed.sampler.train_samples)
    assert of_32 == SampleOrder(samples, 0).next_indices(len(of_32))


def _build(tmp, letter: str, n_docs: int):
    return letter_store(tmp, letter, n_docs)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix114")
    return [_build(tmp, "a", 30), _build(tmp, "b", 20)]


def _mixed(stores, weights) -> BatchLoader:
    mix = store_mix(stores, weights)
    return BatchLoader(mix, 4, seed=0)


def _draw(loader: BatchLoader, steps: int) -> list[tuple[int, int]]:
    """(store, sample of that store) of each row of `steps` global batches."""
    return [loader.samples.locate(k) for _ in range(steps) for k in loader.next_indices()]


def test_a_resume_on_a_reweighted_mix_goes_on_in_each_store_where_it_was(stores):
    """3 batches of 4 at 50:50, resumed at 80:20 for 5 more: each store's samples, before and after, are its own
    order's first ones (the same cursor in the 80:20 blend put store a at its 10th sample where it had given 6,
    skipping 4, and store b at its 3rd, drawing 3 again), and the 20 after the resume are 16 of a, 4 of b."""
    old = _mixed(stores, [0.5, 0.5])
    before = _draw(old, 3)
    new = _mixed(stores, [0.8, 0.2])
    note = new.load_state_dict(json.loads(json.dumps(old.state_dict())), allow_changes=True)
    after = _draw(new, 5)
    reference = _draw(_mixed(stores, [0.5, 0.5]), 30)
    for store in (0, 1):
        own = [j for s, j in before + after if s == store]
        assert own == [j for s, j in reference if s == store][:len(own)], store
    assert [s for s, _ in after].count(0) == 16
    assert "each store goes on from its own place" in note
    # resumed again on the new mix: its position takes up the same schedule, exactly
    again = _mixed(stores, [0.8, 0.2])
    assert again.load_state_dict(json.loads(json.dumps(new.state_dict()))) is None
    assert _draw(again, 4) == _draw(new, 4)
