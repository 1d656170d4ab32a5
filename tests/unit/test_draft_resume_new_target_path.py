"""A draft run resumed with another --draft.target (the step-N directory the draft trained against, as
checkpoint/manifest.py's refusal of a moved-on target advises, with --checkpoint.allow_changes true): the
saved config.toml's model.init_from, which config/load.py derived from the old draft.target, was kept and
the resume refused as "model.init_from is given too; drop model.init_from", a key the user never gave,
with or without allow_changes: no command line resumed the draft. Now the change is said as the draft's
(refused unless asked) and, asked, the new target is the model."""

import pytest

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer
from probes import DRAFT_QUIET, tiny_target_run

QUIET = DRAFT_QUIET


@pytest.fixture(scope="module")
def draft_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("draft-new-target")
    corpus, checkpoints = tiny_target_run(base)
    Trainer(load_config(None, [*QUIET, *corpus, f"--draft.target={checkpoints}", "--train.steps=1",
                               f"--train.run_dir={base / 'd'}"]), log=lambda *a, **k: None).run()
    return base


def test_another_target_path_is_said_as_the_drafts_change(draft_run):
    step = draft_run / "t" / "checkpoints" / "step-00000001"
    resume = [f"--train.run_dir={draft_run / 'd'}", "--checkpoint.resume=auto", f"--draft.target={step}"]
    with pytest.raises(ConfigError, match=r"would change .*draft\.target .*--checkpoint\.allow_changes true") as e:
        load_run_config(None, resume, False)
    assert "drop model.init_from" not in str(e.value)
    cfg, resumed = load_run_config(None, [*resume, "--checkpoint.allow_changes=true"], False)
    assert cfg.draft.target == str(step) and cfg.model.init_from == str(step)
    assert any(change.startswith("draft.target") for change in resumed.changes)


def test_the_same_target_resumes_unchanged(draft_run):
    cfg, resumed = load_run_config(None, [f"--train.run_dir={draft_run / 'd'}", "--checkpoint.resume=auto"], False)
    assert cfg.model.init_from == cfg.draft.target == str(draft_run / "t" / "checkpoints")
    assert not resumed.changes


def test_a_damaged_target_is_named_as_the_draft_target(draft_run, tmp_path):
    """It was said as "model.init_from: checkpoint ... is damaged", a key the user never gave."""
    import shutil

    from longctx.checkpoint.manifest import CheckpointError

    copy = tmp_path / "checkpoints" / "step-00000001"
    shutil.copytree(draft_run / "t" / "checkpoints" / "step-00000001", copy)
    shard = next(copy.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    corpus = [f"--data.corpus={draft_run / 'docs'}", "--data.tokenizer=byte"]
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={copy}", "--train.steps=1",
                             f"--train.run_dir={tmp_path / 'd'}"])
    with pytest.raises(CheckpointError, match=r"^draft\.target: checkpoint .* is damaged.*an earlier step of"):
        Trainer(cfg, log=lambda *a, **k: None).run()
