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


@pytest.mark.parametrize("max_seq_len, written, noted", [(256, 512, False), (512, 512, False), (1024, 1024, True)])
def test_a_yarn_export_gives_older_transformers_its_factor(max_seq_len, written, noted):
    """transformers before 4.56 took yarn's factor as max_position_embeddings / original whenever the original
    is given (huggingface/transformers#38224): an export writing the run's max_seq_len (256 at original 128 x 4)
    made those readers rotate with factor 2. It writes original x factor when that is longer; when the run
    trained past it, the export says so."""
    from longctx.config import load_config
    from longctx.config.hf_export import export_notes, hf_config_from_model

    m = load_config(None, ["--model.layers=1", "--train.seq_len=256", f"--model.max_seq_len={max_seq_len}",
                           "--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=128"]
                    ).model
    config = hf_config_from_model(m)
    assert config["max_position_embeddings"] == written and config["rope_scaling"]["factor"] == 4
    assert any("transformers before 4.56" in n for n in export_notes(m)) == noted


@pytest.mark.parametrize("key, value, noted", [("attention_dropout", 0.1, True), ("attention_dropout", 0.0, False),
                                               ("resid_pdrop", 0.05, True), ("hidden_dropout", None, False)])
def test_dropout_in_config_json_is_said_not_silently_dropped(tmp_path, key, value, noted):
    """transformers applies a config's attention_dropout while training; longctx applies none, so a
    fine-tune from such weights says so on the line that names them, instead of differing silently."""
    import json

    from longctx.config.hf import init_from_notes

    (tmp_path / "config.json").write_text(json.dumps({**_llama(), key: value}))
    notes = init_from_notes(f"hf:{tmp_path}")
    assert any(f"{key}={value}" in n and "without dropout" in n for n in notes) == noted, notes
    assert len(notes) == int(noted)
