"""`checkpoints/latest` given as the path (tab completion ends there) names the step it points at, for every
command that resolves a checkpoint path (export, verify, generate, eval, resume): it was said to hold "no
complete checkpoint ... a save that was interrupted has none", though `latest` names a complete step."""

from __future__ import annotations

import json

import pytest

from longctx.config.checkpoint_paths import (
    CheckpointError,
    check_weights_flag,
    find_checkpoint,
    resolve_checkpoint,
    step_read,
)


def _checkpoints(tmp_path, steps=(3, 5), latest="step-00000003"):
    root = tmp_path / "checkpoints"
    for step in steps:
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"step": step, "model": {"dim": 8}, "files": []}))
    (root / "latest").write_text(latest + "\n")
    return root


def test_the_latest_pointer_names_its_step(tmp_path):
    root = _checkpoints(tmp_path)
    assert resolve_checkpoint(str(root / "latest"), root) == root / "step-00000003"
    assert find_checkpoint(root / "latest") == root / "step-00000003"
    check_weights_flag(str(root / "latest"))  # (no error)


def test_another_file_is_still_refused(tmp_path):
    root = _checkpoints(tmp_path)
    (root / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(str(root / "notes.txt"), root)


def test_the_pointer_naming_a_missing_step_is_said_as_for_its_directory(tmp_path):
    """`latest` names a step deleted or cut short: the newest complete one is read, and eval and generate say so
    (step_read) for the checkpoints directory; given the pointer itself, they said only "(step 5)", as if it
    were the step `latest` names."""
    root = _checkpoints(tmp_path, latest="step-00000007")
    (root / "step-00000007").mkdir()  # (a save that was interrupted: no manifest)
    said = step_read(str(root))
    assert "names step-00000007, which is missing or incomplete" in said
    assert find_checkpoint(root / "latest") == root / "step-00000005"
    assert step_read(str(root / "latest")) == said
    assert step_read(str(_checkpoints(tmp_path / "b") / "latest")) == " (step 3)"


def test_a_resume_of_a_checkpoints_directory_outside_its_run_finds_the_run(tmp_path):
    """--checkpoint.resume CKPTS (or CKPTS/latest) with checkpoint.dir outside the run directory: the saved run
    (its config.toml, which a resume continues) was looked for in a manifest beside `latest` and not found,
    where the step's own path and `auto` found it: the resume then ran on the command line's config alone."""
    from longctx.config.resume import saved_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    root = _checkpoints(tmp_path / "elsewhere")
    for step in root.glob("step-*"):
        manifest = json.loads((step / "manifest.json").read_text())
        (step / "manifest.json").write_text(json.dumps({**manifest, "run_dir": str(run)}))
    for spec in (root / "step-00000003", root, root / "latest"):
        assert saved_run_dir({"checkpoint": {"resume": str(spec)}}) == run, spec
    assert saved_run_dir({"checkpoint": {"resume": "auto", "dir": str(root)}}) == run
