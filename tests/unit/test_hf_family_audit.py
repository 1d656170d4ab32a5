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


QWEN_WINDOW_CASES = [(family, use, below, layers) for family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                     for use in (False, True) for below in (0, 1, 3, 28) for layers in (2, 4)]


@pytest.mark.parametrize("family, use, below, layers", QWEN_WINDOW_CASES)
def test_windowed_layers_are_the_ones_transformers_config_classes_window(family, use, below, layers):
    """Which layers a Qwen config.json windows, as transformers' own classes derive it (Qwen2 / Qwen3 from
    max_window_layers on, Qwen2-MoE its even layers below it, Qwen3-MoE every layer); longctx refused
    every use_sliding_window, also where transformers windows no layer."""
    transformers = pytest.importorskip("transformers")
    from longctx.config.hf_families import windowed_layers

    d = dict(model_type=family, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
             vocab_size=97, use_sliding_window=use, sliding_window=64, max_window_layers=below)
    theirs = transformers.AutoConfig.for_model(**d)
    if getattr(theirs, "layer_types", None) is not None:
        want = [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]
        if theirs.sliding_window in (None, 0):
            want = []
    else:  # (Qwen3-MoE: one window for every layer, or none)
        want = list(range(layers)) if theirs.sliding_window is not None else []
    assert windowed_layers(d) == want


def _qwen2_dir(tmp_path, **window):
    from test_hf import hf_config, random_hf_dir

    return random_hf_dir(tmp_path, hf_config("qwen2", use_sliding_window=True, **window))


def test_a_qwen_whose_window_reaches_no_layer_loads_and_matches_transformers(tmp_path):
    """use_sliding_window with max_window_layers >= the layers: transformers windows no layer, so past
    the window its logits are full attention's, as longctx's (refused before)."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from test_hf import max_err, tokens

    from longctx.models.hf import load_hf

    d, ref = _qwen2_dir(tmp_path, sliding_window=16, max_window_layers=2)
    assert max_err(load_hf(d), ref, tokens(seq=64)) < 1e-4  # 64 tokens: four windows long


def test_a_windowed_qwen_is_refused_within_its_window_and_exported_as_it_ran(tmp_path):
    """A Qwen2 whose layer 1 is windowed: refused when the length passes the window (the message says
    use_sliding_window false), loaded at the window, and its export keeps the window keys, so
    transformers windows the same layer of the export."""
    transformers = pytest.importorskip("transformers")
    from test_untruths_export_ids import checkpoint, exported

    from longctx.config import load_config
    from longctx.config.hf import HFFormatError

    d, _ = _qwen2_dir(tmp_path, sliding_window=64, max_window_layers=1)
    with pytest.raises(HFFormatError, match=r"sliding_window=64.*use_sliding_window false"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=128"])
    assert load_config(overrides=[f"--model.init_from=hf:{d}", "--model.max_seq_len=64",
                                  "--train.seq_len=64"]).model.family == "qwen2"
    tmp_path = tmp_path / "export"
    tmp_path.mkdir()
    step = checkpoint(tmp_path, "byte", [f"--model.init_from=hf:{d}", "--model.max_seq_len=64", "--train.seq_len=64",
                                         "--model.layers=2"])
    written, auto, _ = exported(tmp_path, step)
    assert (written["use_sliding_window"], written["sliding_window"], written["max_window_layers"]) == (True, 64, 1)
    assert auto.layer_types == ["full_attention", "sliding_attention"] and isinstance(auto, transformers.Qwen2Config)
