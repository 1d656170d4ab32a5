"""A stage the model or the layout cannot train is refused at start, naming the stage (audit stages109).

A 4K -> 32K -> 128K plan is read by its stages: "train.stages: sequence length 98 is not divisible" left the
user to find which one, and a stage past model.max_seq_len was said twice, the second time as
"train.seq_len (N) exceeds model.max_seq_len", a key the command line never gave (the last stage's length)."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout


def test_a_length_the_layout_cannot_cut_names_its_stage():
    cfg = load_config(None, ["--train.stages=64:2,98:2:4", "--parallel.ctx=2"])
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 2)
    assert str(e.value).startswith("train.stages: stage 2 (98:2:4): sequence length 98 is not divisible"), e.value


def test_stages_past_max_seq_len_are_named_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.stages=64:2,4096:2,2048:1", "--model.max_seq_len=1024"])
    text = " ".join(str(e.value).split())
    assert "stage 2 (4096:2) of 4096 tokens, stage 3 (2048:1) of 2048 tokens, more than model.max_seq_len" in text
    assert "train.seq_len" not in text, text
    with pytest.raises(ConfigError, match=r"train.seq_len \(4096\) exceeds model.max_seq_len"):  # (no stages)
        load_config(None, ["--train.seq_len=4096", "--model.max_seq_len=1024"])


def test_a_one_token_stage_is_refused_as_the_stage():
    """train.seq_len's rule (at least 2) read the last stage only; a first stage of 1 token was refused only
    later, at the layout check, by the zigzag layout's arithmetic ("not divisible by 2 ...; use 2 or 2")."""
    with pytest.raises(ConfigError, match=r"train.stages: stage 1 \(1:1\) must be at least 2 tokens long"):
        load_config(None, ["--train.stages=1:1,64:1"])
