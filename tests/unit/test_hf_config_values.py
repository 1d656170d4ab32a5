"""A config.json value of the wrong type, read through the entry every command takes (model.init_from = hf:DIR:
`train`, `eval --checkpoint hf:DIR`, `generate`): an HFFormatError naming the key, not the bare TypeError /
AttributeError / ZeroDivisionError of the first reader that computed with it (default_max_seq_len ran before
the checks of model_fields_from_hf), and never a value taken silently (a linear factor "2" multiplied
max_position_embeddings as text: a 256-digit model.max_seq_len)."""

import json

import pytest
from test_hf import hf_config

from longctx.config import load_config
from longctx.config.hf import HFFormatError

CASES = {
    "max_position_embeddings-null": (dict(max_position_embeddings=None), "max_position_embeddings is null"),
    "hidden_size-text": (dict(hidden_size="64"), "hidden_size is \"64\", not a positive integer"),
    "heads-zero": (dict(num_attention_heads=0), "num_attention_heads is 0"),
    "heads-null": (dict(num_attention_heads=None), "num_attention_heads is null"),
    "rope_scaling-text": (dict(rope_scaling="linear"), "rope_scaling is \"linear\", not an object"),
    "linear-factor-text": (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), "rope_scaling.factor is \"2\""),
    "llama3-original-text": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": "32"}),
                             "rope_scaling.original_max_position_embeddings is \"32\""),
    "window-text": (dict(model_type="mistral", sliding_window="4096"), "sliding_window is \"4096\""),
    "kv-heads-bool": (dict(num_key_value_heads=True), "num_key_value_heads is true"),
    # bool("false") is True: an untied model read as tied, a llama given biases (transformers 5 refuses the text)
    "tie-text": (dict(tie_word_embeddings="false"), "tie_word_embeddings is \"false\", not true or false"),
    "bias-text": (dict(attention_bias="false"), "attention_bias is \"false\""),
}


def _dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return f"--model.init_from=hf:{tmp_path}"


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_value_is_refused_naming_its_key(tmp_path, case):
    extra, said = CASES[case]
    with pytest.raises(HFFormatError, match=f"config.json: {said}"):
        load_config(overrides=[_dir(tmp_path, hf_config("llama", **extra))])


def test_an_unsupported_family_is_said_before_its_missing_keys(tmp_path):
    config = {k: v for k, v in hf_config("llama", model_type="gemma").items() if k != "max_position_embeddings"}
    with pytest.raises(HFFormatError, match="model_type 'gemma' is not supported"):  # (was KeyError)
        load_config(overrides=[_dir(tmp_path, config)])


def test_null_counts_and_initializer_range_read_as_transformers_reads_them(tmp_path):
    """null: as many kv heads as heads, hidden_size / heads, no window, the default init scale (was a TypeError)."""
    config = hf_config("mistral", num_key_value_heads=None, head_dim=None, sliding_window=None,
                       initializer_range=None)
    m = load_config(overrides=[_dir(tmp_path, config), "--train.seq_len=256"]).model
    assert (m.kv_heads, m.resolved_head_dim, m.max_seq_len, m.init_std) == (4, 16, 256, 0.02)
