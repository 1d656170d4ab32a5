"""`checkpoints/latest` given as the path (tab completion ends there) names the step it points at, for every
command that resolves a checkpoint path (export, verify, generate, eval, resume): it was said to hold "no
complete checkpoint ... a save that was interrupted has none", though `latest` names a complete step."""

from __future__ import annotations

import json

import pytest

from longctx.config.checkpoint_paths import CheckpointError, check_weights_flag, find_checkpoint, resolve_checkpoint


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
