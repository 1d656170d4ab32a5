"""A weight-shaping override against hf:DIR whose config.json leaves the key out: the refusal says the file has no
such key and that transformers' config-class default applies (the value it then requires), not that the file holds
None (it said "config.json has num_local_experts=None, so model.moe.experts must be 8")."""

import json

import pytest

from longctx.config import load_config
from longctx.config.hf import HFFormatError

SPARSE = dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              vocab_size=300)


@pytest.mark.parametrize("override, key, must", [
    ("--model.moe.experts=4", "num_local_experts", "model.moe.experts must be 8"),
    ("--model.moe.top_k=1", "num_experts_per_tok", "model.moe.top_k must be 2"),
    ("--model.kv_heads=2", "num_key_value_heads", "model.kv_heads must be 8"),
])
def test_an_absent_key_is_said_absent_with_the_default_it_takes(tmp_path, override, key, must):
    (tmp_path / "config.json").write_text(json.dumps(SPARSE))
    with pytest.raises(HFFormatError) as e:
        load_config(overrides=[f"--model.init_from=hf:{tmp_path}", override])
    said = str(e.value)
    assert f"config.json has no {key} (transformers' MixtralConfig default applies), so {must}" in said, said
    assert "=None" not in said


def test_a_present_key_is_still_quoted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SPARSE, "num_local_experts": 6}))
    with pytest.raises(HFFormatError, match="config.json has num_local_experts=6, so model.moe.experts must be 6"):
        load_config(overrides=[f"--model.init_from=hf:{tmp_path}", "--model.moe.experts=4"])
