"""checkpoint/identity.py: the identity a GliDe draft records of its target. Two Hugging Face models of
one shape differ; a copy of the same weights does not; a longctx checkpoint's comes from its manifest."""

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402

from longctx.checkpoint.identity import weights_identity  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402


def test_hf_weights_of_one_shape_differ_and_a_copy_does_not(tmp_path):
    a, ref = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama"), name="a")
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert weights_identity(f"hf:{a}") == weights_identity(f"hf:{copy}") is not None
    ref.model.norm.weight.data += 1.0  # one tensor changed, the rest and every shape the same
    ref.save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text((a / "config.json").read_text())
    assert weights_identity(f"hf:{tmp_path / 'b'}") != weights_identity(f"hf:{a}")
    assert weights_identity(f"hf:{tmp_path / 'none'}") is None


def test_a_checkpoint_identity_is_its_files_checksums(tmp_path):
    step = tmp_path / "step-00000002"
    step.mkdir()
    (step / "weights.bin").write_bytes(b"one")
    write_manifest(step, step=2, layout={}, model={})
    first = weights_identity(str(step))
    (step / "weights.bin").write_bytes(b"two")
    write_manifest(step, step=2, layout={}, model={})
    assert first != weights_identity(str(step)) and len(first) == 16
    assert json.loads((step / "manifest.json").read_text())["files"][0]["path"] == "weights.bin"
