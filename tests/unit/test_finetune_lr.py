"""A run from trained weights (model.init_from) that names no learning rate takes the fine-tuning
default, not the from-scratch 3e-3 (issue 53 item 7); a given rate is kept, with a note when it is a
from-scratch one; a GliDe draft (random weights beside its target) keeps the from-scratch rate."""

import json

import pytest

from longctx.config import load_config, to_toml
from longctx.config.load import FINETUNE_LR, lr_note

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama", hidden_size=64, num_attention_heads=4,
                                                                num_key_value_heads=2, max_position_embeddings=4096)))
    return d


def test_init_from_without_a_rate_takes_the_finetuning_default(hf_dir):
    scratch = load_config(None, [])
    assert scratch.train.lr == 3e-3 and "fine-tuning" not in lr_note(scratch)
    tuned = load_config(None, [f"--model.init_from=hf:{hf_dir}"])
    assert tuned.train.lr == FINETUNE_LR == 2e-5
    assert "fine-tuning default" in lr_note(tuned)
    # written into config.toml as any value: a resume (or --config) of it keeps the same rate
    saved = hf_dir.parent / "config.toml"
    saved.write_text(to_toml(tuned))
    assert load_config(saved).train.lr == FINETUNE_LR


def test_a_glide_draft_keeps_the_from_scratch_rate():
    from longctx.config.load import _finetune_lr

    raw = {"model": {"init_from": "runs/a/checkpoints"}, "draft": {"target": "runs/a/checkpoints"}}
    assert "lr" not in _finetune_lr(raw).get("train", {})  # the draft's own weights start random


def test_a_given_rate_is_kept_and_a_from_scratch_one_is_noted(hf_dir):
    cfg = load_config(None, [f"--model.init_from=hf:{hf_dir}", "--train.lr=3e-3"])
    assert cfg.train.lr == 3e-3
    note = lr_note(cfg)
    assert "from-scratch rate" in note and "2e-05" in note
    quiet = load_config(None, [f"--model.init_from=hf:{hf_dir}", "--train.lr=1e-4"])
    assert lr_note(quiet) == "lr 0.0001"


def test_a_config_file_rate_counts_as_given(hf_dir, tmp_path):
    cfg = load_config("configs/debug.toml", [f"--model.init_from=hf:{hf_dir}"])
    assert cfg.train.lr == 3e-3 and "from-scratch rate" in lr_note(cfg)
