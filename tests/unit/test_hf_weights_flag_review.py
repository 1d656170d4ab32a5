"""generate/eval --checkpoint (bench decode --target) checked in the flag's words (config/checkpoint_paths.py):
a GGUF file (hf:FILE.gguf or FILE.gguf) lost the config's "is a GGUF file ... longctx checkpoint import" advice
and was called "not a directory"; and the step said beside a checkpoint named directly was its directory's name
("(step best)" for a renamed or copied one), not the step its manifest records."""

import json

import pytest

from longctx.config.checkpoint_paths import check_weights_flag, step_read
from longctx.errors import ConfigError


@pytest.mark.parametrize("prefix", ["hf:", ""])
def test_a_gguf_file_is_told_how_to_convert(tmp_path, prefix):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ConfigError, match=f"--target {prefix}{gguf}: {gguf} is a GGUF file.*longctx checkpoint "
                                          f"import {gguf} --out DIR`, then pass --target hf:DIR"):
        check_weights_flag(f"{prefix}{gguf}", "--target")


def test_a_checkpoint_named_directly_says_its_manifests_step(tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    (best / "manifest.json").write_text(json.dumps({"step": 7, "model": {}}))
    assert step_read(str(best)) == " (step 7)"
    copy = tmp_path / "checkpoints" / "step-00000003"  # (a step's name, another step's manifest: the manifest's)
    copy.mkdir(parents=True)
    (copy / "manifest.json").write_text(json.dumps({"step": 12, "model": {}}))
    assert step_read(str(copy)) == " (step 12)"
    (tmp_path / "checkpoints" / "latest").write_text(f"{copy}\n")  # (a `latest` holding the step's own path)
    assert step_read(str(tmp_path / "checkpoints")) == " (step 12)"
