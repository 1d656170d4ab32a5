"""Regressions found auditing longctx's reading of Hugging Face families against transformers.

YaRN's `attention_factor` multiplies cos and sin as transformers reads it (its `attention_factor is
None` test: only a missing or null key is derived from factor and mscale). longctx keeps 0 as "derive
it", so a config.json with attention_factor 0 loaded as a model whose q.k were scaled by the derived
factor (1.139 at factor 4) where transformers' are all 0: logits off by 5.7 on a tiny model, silently.
Such a value is refused now; null, absent and positive values read as before."""

import pytest

from longctx.config.hf import HFFormatError, model_fields_from_hf


def _llama(**rope) -> dict:
    return dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=97, max_position_embeddings=256,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, **rope})


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, "1.3"])
def test_yarn_attention_factor_transformers_would_apply_is_not_read_as_derive_it(bad):
    with pytest.raises(HFFormatError, match=r"yarn attention_factor=.*must be positive"):
        model_fields_from_hf(_llama(attention_factor=bad), "x/config.json")


def test_yarn_attention_factor_absent_null_or_positive_reads_as_before():
    assert model_fields_from_hf(_llama())["rope_attention_factor"] == 0.0  # derived (longctx's 0)
    assert model_fields_from_hf(_llama(attention_factor=None))["rope_attention_factor"] == 0.0
    assert model_fields_from_hf(_llama(attention_factor=1.3))["rope_attention_factor"] == 1.3
