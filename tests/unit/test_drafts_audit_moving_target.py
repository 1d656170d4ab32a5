"""A draft run whose draft.target is a `<run>/checkpoints` directory while that run saves (an audit for silent wrong
results): the directory names its latest step, which moves on. The draft's record (the manifest's `draft.target`: the
path and identity that generate and a resume compare) named the latest step as of the end of the target's load, a
second resolution: a save landing while the target loaded made the record name a step the draft never read (its
weights another run's here), so generate refused the draft beside the target it learned from and took it beside the
newer one. draft.target is now resolved once, on rank 0, and that step is loaded (by every rank) and recorded."""

import shutil
import sys
from pathlib import Path

import pytest

import longctx.train.glide as glide_train
from longctx.checkpoint.glide import glide_manifest
from longctx.checkpoint.identity import weights_identity
from longctx.config import load_config
from longctx.config.checkpoint_paths import latest_checkpoint
from longctx.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probes import DRAFT_QUIET, tiny_target_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_the_record_names_the_step_loaded_while_the_target_run_saves_a_newer_one(tmp_path, monkeypatch, kind):
    corpus, target = tiny_target_run(tmp_path)
    other = tmp_path / "other"  # (a same-shape model: the newer save's weights, unlike the loaded step's)
    Trainer(load_config(None, [*DRAFT_QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                               "--train.steps=1", "--train.seed=5", f"--train.run_dir={other}"]),
            log=lambda *a, **k: None).run()
    loaded = latest_checkpoint(target)
    newer = latest_checkpoint(other / "checkpoints")
    load = glide_train.load_weights

    def load_while_the_target_saves(model, source, *args, **kwargs):
        path = load(model, source, *args, **kwargs)
        shutil.copytree(newer, target / "step-00000009")
        (target / "latest").write_text("step-00000009\n")
        return path

    monkeypatch.setattr(glide_train, "load_weights", load_while_the_target_saves)
    run = tmp_path / "draft"
    cfg = load_config(None, [*DRAFT_QUIET, *corpus, f"--draft.target={target}", "--train.steps=1",
                             f"--draft.kind={kind}", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    assert latest_checkpoint(target).name == "step-00000009"
    record = glide_manifest(run / "checkpoints")
    assert record["target"]["path"] == str(loaded.resolve()), "the record names a step the draft never read"
    assert record["target"]["identity"] == weights_identity(str(loaded)) != weights_identity(str(newer))
