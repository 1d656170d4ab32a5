"""model.rope_attention_factor multiplies YaRN's cos and sin, so q.k by its square: a negative one trained as its
positive twin (--model.rope_attention_factor -1, meant as "derive it" the way parallel.dp_shard -1 means "the rest",
scaled by 1 where the derived factor at rope_factor 8 is 1.208), and export wrote it into a config.json that
hf_rope.py itself refuses (attention_factor must be positive). Refused where the config is read; 0 still derives."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.models.llama import rope_attention_scale

YARN = ["--model.rope_scaling=yarn", "--model.rope_factor=8", "--train.seq_len=64"]


@pytest.mark.parametrize("value", ["-1", "-1.2", "-0.5"])
def test_a_negative_yarn_attention_factor_is_refused(value):
    with pytest.raises(ConfigError, match="rope_attention_factor"):
        load_config(None, [*YARN, f"--model.rope_attention_factor={value}"])


def test_zero_derives_and_a_positive_factor_is_taken():
    derived = load_config(None, [*YARN, "--model.rope_attention_factor=0"]).model
    assert rope_attention_scale(derived) == pytest.approx(0.1 * 2.0794415 + 1)
    assert rope_attention_scale(load_config(None, [*YARN, "--model.rope_attention_factor=1.3"]).model) == 1.3
