"""A resumed draft run with draft.vocab > 0 counted its whole training store again at every start, only for
the checkpoint's saved ids to overwrite the result (a pass over the data per resume: minutes on a large
store). The Trainer now chooses the vocabulary once it knows the run starts at step 1; a resume keeps the
checkpoint's ids, the same as the uninterrupted run's."""

import pytest

from longctx.config import load_config
from longctx.train import glide
from longctx.train.trainer import Trainer
from probes import DRAFT_QUIET, tiny_target_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("draft-vocab-resume")
    corpus, checkpoints = tiny_target_run(base)
    return base, [*DRAFT_QUIET, *corpus, f"--draft.target={checkpoints}", "--draft.vocab=48"]


def _quiet(*a, **k):
    pass


def test_a_resumed_draft_keeps_its_saved_vocabulary_without_counting_the_store(runs, monkeypatch):
    base, flags = runs
    run = [*flags, f"--train.run_dir={base / 'd'}", "--checkpoint.interval=1"]
    first = Trainer(load_config(None, [*run, "--train.steps=1"]), log=_quiet)
    first.run()
    chosen = first.model.draft.vocab.ids.clone()
    assert chosen.unique().numel() == 48  # (a vocabulary was chosen: 48 distinct ids, not the zeros it starts as)

    def counted(*a, **k):
        raise AssertionError("a resumed draft run counted its training store again")

    monkeypatch.setattr(glide, "token_counts", counted)
    resumed = Trainer(load_config(None, [*run, "--train.steps=2", "--checkpoint.resume=auto"]), log=_quiet)
    assert resumed.start_step == 1
    assert resumed.model.draft.vocab.ids.equal(chosen)
    resumed.run()


def test_a_draft_run_that_starts_counts_its_store(runs, monkeypatch):
    base, flags = runs
    calls = []
    real = glide.token_counts
    monkeypatch.setattr(glide, "token_counts", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer = Trainer(load_config(None, [*flags, f"--train.run_dir={base / 'fresh'}", "--train.steps=1"]), log=_quiet)
    assert calls == [1] and trainer.model.draft.vocab.ids.unique().numel() == 48
