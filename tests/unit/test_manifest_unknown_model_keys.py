"""A checkpoint whose manifest's [model] records a key this longctx does not know (written by a newer longctx,
whose model computes with it) is refused by every reader of its model: export wrote it out without the key
(model_config leaves unknown keys out), generate died on a KeyError, a run starting from it would build another
model. No key has ever left ModelConfig, so a checkpoint of any earlier longctx still reads."""

import pytest

pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.cli import main  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.checkpoint_paths import CheckpointError  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402


def _from_a_newer_longctx(tmp_path):
    step = checkpoint(tmp_path, "byte")
    model = to_dict(load_config(overrides=["--model.layers=1"]))["model"]
    write_manifest(step, step=1, layout={}, model={**model, "attention_sinks": 4}, tokenizer="byte")
    return step


def test_export_refuses_and_writes_nothing(tmp_path):
    step = _from_a_newer_longctx(tmp_path)
    with pytest.raises(CheckpointError, match=r"does not know \(attention_sinks\).*newer longctx"):
        export_hf(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_generate_and_a_run_from_it_refuse_with_a_clear_error(tmp_path, capsys):
    step = _from_a_newer_longctx(tmp_path)
    assert main(["generate", "--checkpoint", str(step), "--prompt", "hi", "--max-new-tokens", "2"]) == 1
    assert "attention_sinks" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(CheckpointError, match="attention_sinks"):
        load_config(overrides=[f"--model.init_from={step}"])


def test_a_manifest_of_known_keys_still_reads(tmp_path):
    step = checkpoint(tmp_path, "byte")
    assert load_config(overrides=[f"--model.init_from={step}"]).model.layers == 1
