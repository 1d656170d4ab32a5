"""Reshard audit: a checkpoint of another model (larger, another preset, another vocabulary) is refused by the
library path's resume (train(), no CLI config merge) with a message naming the difference, before any step."""

import pytest

from longctx.checkpoint.manifest import CheckpointError
from longctx.config import load_config
from longctx.train.trainer import train

BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=200",
        "--train.seq_len=128"]


def _train(run_dir, *args):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    _train(d, "--train.steps=2")
    return d / "checkpoints" / "step-00000002"


@pytest.mark.parametrize("change, named", [("--model.preset=debug-moe", "moe"), ("--model.vocab_size=512", "vocab"),
                                            ("--model.layers=3", "layers")])
def test_another_model_is_refused_before_any_step(saved, change, named, tmp_path):
    with pytest.raises(CheckpointError) as err:
        _train(tmp_path, "--train.steps=4", change, f"--checkpoint.resume={saved}")
    text = str(err.value)
    print(change, "->", text)
    assert "another model" in text and named in text and "Nothing was loaded" in text
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").glob("step-*"))
