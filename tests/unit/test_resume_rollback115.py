"""A rollback past a resume that edited the run's config (config/resume_source.py).

A run trains steps 1-2 under its config C0, saving each step; a resume at step 2 changes the model, the data and
the batch (--checkpoint.allow_changes) and trains step 3 under C1, which it writes to config.toml. Rolled back to
step 1 with nothing else given, the resume compared against config.toml (C1): it said "nothing changed" and trained
step 1's weights under C1, though a resume of step 1 before the edit refused those model and data changes unless
asked. A checkpoint now records the config it trained under: the changes are said and refused against that, those
that come from config.toml said so, with the flags that give the checkpoint's values back.
"""

import json
import shutil

import pytest

from longctx.checkpoint.manifest import MANIFEST, DamagedManifest, read_manifest
from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer
from manifest_edits import rewrite_manifest
from simulated_crash import run_until_crash

QUIET = lambda *a, **k: None  # noqa: E731
BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--train.eval_interval=0",
        "--train.warmup_steps=1", "--checkpoint.interval=1", "--checkpoint.keep=5", "--train.global_batch=2",
        "--train.seq_len=32"]
EDITS = ["--model.norm_eps=1e-06", "--data.doc_mask=false", "--train.global_batch=4"]  # C1's, at the resume
STEP_1 = "checkpoints/step-00000001"
FROM_RUN_FILE = "(the run's config.toml, changed after step 1)"


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """The run: steps 1-2 under C0, resumed at step 2 with EDITS (allowed) for step 3."""
    run = tmp_path_factory.mktemp("edited") / "run"
    Trainer(load_config(None, [*BASE, "--train.steps=2", f"--train.run_dir={run}"]), log=QUIET).run()
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=3",
                                          "--checkpoint.allow_changes=true", *EDITS], False)
    assert "model.norm_eps 1e-05 -> 1e-06" in resumed.describe()  # (the edit itself, said as before)
    Trainer(cfg, log=QUIET).run()
    assert (run / "checkpoints" / "step-00000003").is_dir()
    return run


def _rollback(run, *extra):
    return load_run_config(None, [f"--checkpoint.resume={run / STEP_1}", *extra], False)


def test_a_rollback_says_each_change_since_its_checkpoint_and_where_it_comes_from(edited):
    cfg, resumed = _rollback(edited, "--checkpoint.allow_changes=true")
    said = resumed.describe()
    for change in ("model.norm_eps 1e-05 -> 1e-06", "data.doc_mask true -> false", "train.global_batch 2 -> 4",
                   "train.steps 2 -> 3"):
        assert f"{change} {FROM_RUN_FILE}" in said, said
    assert "nothing changed" not in said
    # config.toml stays the base: the run's latest intent, now said
    assert (cfg.model.norm_eps, cfg.data.doc_mask, cfg.train.global_batch) == (1e-6, False, 4)


def test_a_rollback_refuses_the_model_and_data_changes_of_config_toml_unless_asked(edited):
    with pytest.raises(ConfigError) as e:
        _rollback(edited)
    message = str(e.value)
    assert "would change the model: model.norm_eps 1e-05 -> 1e-06 " + FROM_RUN_FILE in message
    assert "the data: data.doc_mask true -> false " + FROM_RUN_FILE in message
    assert "--model.norm_eps=1e-05 --data.doc_mask=true" in message and "allow_changes true" in message
    assert "global_batch" not in message  # (a batch change needs no flag: said, not refused)


def test_giving_the_checkpoints_values_back_resumes_it_under_them(edited):
    cfg, resumed = _rollback(edited, "--model.norm_eps=1e-05", "--data.doc_mask=true")
    assert (cfg.model.norm_eps, cfg.data.doc_mask) == (1e-5, True)
    said = resumed.describe()
    assert "model.norm_eps 1e-06 -> 1e-05 in the run's config.toml (back to step 1's)" in said
    assert f"train.global_batch 2 -> 4 {FROM_RUN_FILE}" in said


def test_the_newest_checkpoint_is_compared_with_its_own_config(edited):
    """Step 3 trained under C1, which config.toml holds: nothing changed (as auto says)."""
    for spec in (f"--checkpoint.resume={edited / 'checkpoints' / 'step-00000003'}", "--checkpoint.resume=auto"):
        _, resumed = load_run_config(None, [spec, f"--train.run_dir={edited}"], False)
        assert resumed.describe().endswith("nothing changed")


def test_a_rollback_with_no_edit_in_between_says_nothing_changed(tmp_path):
    """Steps 1-2, a crash at 3, a resume with nothing given that trains step 3: rolled back to step 1, nothing
    changed."""
    run = tmp_path / "run"
    run_until_crash(Trainer(load_config(None, [*BASE, "--train.steps=3", f"--train.run_dir={run}"]), log=QUIET), 3)
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto"], False)
    assert resumed.describe().endswith("nothing changed")
    Trainer(cfg, log=QUIET).run()
    _, resumed = _rollback(run)
    assert resumed.describe().endswith("nothing changed")


def _copy_without_record(edited, tmp_path):
    """The run copied, its step 1 as a checkpoint written before checkpoints recorded their config."""
    run = tmp_path / "run"
    shutil.copytree(edited, run)
    rewrite_manifest(run / STEP_1, lambda manifest: manifest.pop("config", None))
    return run


def test_a_checkpoint_without_a_recorded_config_is_compared_with_config_toml_as_before(edited, tmp_path):
    _, resumed = _rollback(_copy_without_record(edited, tmp_path))
    assert resumed.describe().endswith("nothing changed")


def test_the_recorded_config_is_covered_by_the_manifests_checksum(edited, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(edited, run)
    path = run / STEP_1 / MANIFEST
    manifest = json.loads(path.read_text())
    assert "norm_eps = 1e-05" in manifest["config"]  # (C0's, which step 1 trained under)
    manifest["config"] = manifest["config"].replace("norm_eps = 1e-05", "norm_eps = 1e-06")
    path.write_text(json.dumps(manifest))
    with pytest.raises(DamagedManifest, match="checksum"):
        read_manifest(run / STEP_1)


def test_a_rollback_past_an_allowed_stage_edit_is_refused_as_a_direct_resume_is(tmp_path):
    """Stages '32:2,64:2'; resumed at step 2 as '16:2,64:2' (allowed: stage 1 was finished) for steps 3-4. Rolled
    back to step 1, stage 1, which it trained at 32 tokens, would go on at 16: refused, said as config.toml's."""
    run = tmp_path / "run"
    base = [a for a in BASE if not a.startswith("--train.seq_len")]
    Trainer(load_config(None, [*base, "--train.stages=32:2,64:2", f"--train.run_dir={run}"]), log=QUIET).run()
    cfg, _ = load_run_config(None, [f"--checkpoint.resume={run / 'checkpoints' / 'step-00000002'}",
                                    "--train.stages=16:2,64:2", "--checkpoint.allow_changes=true"], False)
    Trainer(cfg, log=QUIET).run()
    with pytest.raises(ConfigError, match=r"train.stages '32:2,64:2' -> '16:2,64:2' \(the run's config.toml, changed "
                                          r"after step 1\) moves the steps it trained"):
        _rollback(run)


def test_a_change_the_command_line_gives_is_not_said_to_come_from_config_toml(edited):
    """The command line giving config.toml's own value: the change is this command's (said plainly, and the refusal
    says nothing of config.toml for it); one it does not give is still config.toml's."""
    with pytest.raises(ConfigError) as e:
        _rollback(edited, "--model.norm_eps=1e-06")
    message = str(e.value)
    assert "model.norm_eps 1e-05 -> 1e-06;" in message or "model.norm_eps 1e-05 -> 1e-06." in message, message
    assert f"data.doc_mask true -> false {FROM_RUN_FILE}" in message
    assert "--model.norm_eps=1e-05" not in message and "--data.doc_mask=true" in message
    _, resumed = _rollback(edited, "--model.norm_eps=1e-06", "--train.global_batch=4",
                           "--checkpoint.allow_changes=true")
    said = resumed.describe()
    assert "model.norm_eps 1e-05 -> 1e-06," in said and "train.global_batch 2 -> 4," in said, said
    assert f"train.steps 2 -> 3 {FROM_RUN_FILE}" in said
