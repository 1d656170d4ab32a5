"""config.json read as transformers reads it, where longctx once read it otherwise without a word:
rope_scaling beside rope_parameters, Mistral's attention biases, the keys a config.json leaves out
(each family's own defaults) and Mistral's sliding window (4096 when the key is absent)."""

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import hf_config, max_err, random_hf_dir, tokens  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError, model_fields_from_hf  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.models.hf import config_from_hf, load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

TOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                "olmoe": "OlmoeConfig"}


def test_rope_scaling_beside_a_different_rope_parameters_is_refused():
    """transformers reads rope_scaling and drops rope_parameters (its theta too): a file that says two
    things is refused, naming both and the one transformers reads."""
    both = hf_config("qwen3", form="rope_parameters", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     rope_scaling=YARN)
    with pytest.raises(HFFormatError, match=r"rope_scaling=.*rope_parameters=.*transformers reads rope_scaling"):
        config_from_hf(both, "x/config.json")
    # the same settings in both (rope_scaling without rope_theta: the top-level one fills it in): read once
    same = hf_config("qwen3", rope_theta=1e6, rope_parameters={**YARN, "rope_theta": 1e6}, rope_scaling=YARN)
    assert config_from_hf(same).rope_scaling == "yarn" and config_from_hf(same).rope_theta == 1e6
    # ... but without a top-level rope_theta transformers takes its class default (1e4), not rope_parameters'
    del same["rope_theta"]
    with pytest.raises(HFFormatError, match="rope_theta"):
        config_from_hf(same, "x/config.json")


def test_same_rope_in_both_forms_matches_transformers(tmp_path):
    config = hf_config("qwen3", rope_theta=1e6, rope_parameters={**YARN, "rope_theta": 1e6},
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    d, ref = random_hf_dir(tmp_path, config)
    assert max_err(load_hf(d), ref) <= TOL


def test_export_then_a_model_card_rope_scaling_matches_transformers(tmp_path):
    """An export writes RoPE once (rope_theta + rope_scaling, which transformers 4 and 5 both read), so
    adding YaRN as Qwen's model cards say changes the one setting both readers use."""
    cfg = load_config(overrides=["--model.dim=64", "--model.ffn_dim=160", "--model.layers=2", "--model.family=qwen2",
                                 "--model.qkv_bias=true", "--model.rope_theta=1000000"]).model
    out = save_hf(build_model(cfg, seed=7), tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert "rope_parameters" not in written and written["rope_theta"] == 1e6 and written["rope_scaling"] is None
    written["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    (out / "config.json").write_text(json.dumps(written))
    ours = load_hf(out)
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_theta == 1e6
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert max_err(ours, theirs, tokens(vocab=cfg.vocab_size)) <= TOL


def test_mistral_has_no_attention_biases():
    """transformers' Mistral builds q, k, v and o without biases and drops bias tensors: longctx
    neither trains nor exports nor loads them."""
    with pytest.raises(ConfigError, match="mistral has no attention biases"):
        load_config(overrides=["--model.family=mistral", "--model.qkv_bias=true", "--model.out_bias=true"])
    with pytest.raises(HFFormatError, match="attention_bias=true.*Mistral"):
        config_from_hf(hf_config("mistral", attention_bias=True), "x/config.json")
    assert not config_from_hf(hf_config("mistral", attention_bias=False)).qkv_bias


def _bare(family: str, **extra) -> dict:
    """A config.json with the shapes only: every key transformers can default is left out."""
    d = dict(model_type=family, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=300)
    if family == "mistral":
        d["max_position_embeddings"] = 4096  # (its default, 131072, passes Mistral's default window)
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        d.update(num_experts_per_tok=2, num_local_experts=4, num_experts=4)
    return {**d, **extra}


@pytest.mark.parametrize("family", list(CONFIG_CLASS))
def test_missing_keys_take_the_family_defaults(family):
    hf = _bare(family, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = model_fields_from_hf(hf)
    rope = theirs.rope_parameters
    assert ours["norm_eps"] == theirs.rms_norm_eps
    assert ours["rope_theta"] == rope["rope_theta"]
    assert ours["rope_original_max_len"] == rope["original_max_position_embeddings"]
    assert ours["max_seq_len"] == theirs.max_position_embeddings
    assert ours["kv_heads"] == theirs.num_key_value_heads
    assert ours["head_dim"] == (getattr(theirs, "head_dim", None) or 64 // 4)


@pytest.mark.parametrize("family", list(CONFIG_CLASS))
def test_the_defaults_table_is_transformers_own(family):
    """FAMILY_DEFAULTS and MOE_DEFAULTS hold what each config class assumes for a key config.json leaves out."""
    from longctx.config.hf_families import FAMILY_DEFAULTS, MOE_DEFAULTS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(transformers, CONFIG_CLASS[family])()
    for key, value in {**FAMILY_DEFAULTS[family], **MOE_DEFAULTS.get(family, {})}.items():
        got = theirs.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(theirs, key)
        assert got == value, (family, key, got, value)


def test_mistral_without_a_sliding_window_key_has_transformers_default_window():
    with pytest.raises(HFFormatError, match=r"sliding_window=4096 \(MistralConfig's default"):
        config_from_hf(_bare("mistral", max_position_embeddings=8192), "x/config.json")
    assert config_from_hf(_bare("mistral", max_position_embeddings=4096)).max_seq_len == 4096
    assert config_from_hf(_bare("mistral", max_position_embeddings=8192, sliding_window=None)).max_seq_len == 8192
    assert config_from_hf(_bare("mixtral", max_position_embeddings=8192)).max_seq_len == 8192  # (no window)


def test_a_window_binds_the_run_max_seq_len(tmp_path):
    """A Mistral whose window equals its length trains as full attention; extending max_seq_len past the
    window would train full attention where the weights only ever saw the window: refused."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_bare("mistral", sliding_window=256, max_position_embeddings=256,
                                                                 num_key_value_heads=2)))
    ok = load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=256"]).model
    assert ok.family == "mistral" and ok.max_seq_len == 256
    with pytest.raises(HFFormatError, match=r"model.max_seq_len=1024 .*\(sliding_window=256\)"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--model.max_seq_len=1024", "--model.rope_scaling=linear",
                               "--model.rope_factor=4", "--train.seq_len=1024"])


def test_a_window_binds_every_run_started_from_the_weights_and_is_exported(tmp_path):
    """Through a longctx checkpoint too: the window of the Mistral it started from still binds
    model.max_seq_len, and the export writes that window back (transformers runs it as the source ran)."""
    from test_untruths_export_ids import checkpoint, exported

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_bare("mistral", sliding_window=256, max_position_embeddings=256,
                                                    num_key_value_heads=2, num_hidden_layers=1)))
    step = checkpoint(tmp_path, "byte", [f"--model.init_from=hf:{d}", "--train.seq_len=256"])
    written, auto, _ = exported(tmp_path, step)
    assert written["sliding_window"] == 256 and auto.sliding_window == 256
    assert load_config(overrides=[f"--model.init_from={step}", "--train.seq_len=256"]).model.max_seq_len == 256
    with pytest.raises(HFFormatError, match=r"model.max_seq_len=1024 .*\(sliding_window=256\)"):
        load_config(overrides=[f"--model.init_from={step}", "--model.max_seq_len=1024", "--train.seq_len=1024"])


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta", "max_position_embeddings"])
@pytest.mark.parametrize("bad", [None, "1e-6", True])
def test_a_null_or_text_number_is_refused_naming_the_key(key, bad):
    """An explicit null (or a string, or a bool) where a number belongs raised a bare TypeError from
    float(None) (or, for a bool, read True as 1.0 silently): now an HFFormatError naming the key and the
    family default. rope_parameters' own rope_theta is checked as the one read."""
    with pytest.raises(HFFormatError, match=f"{key} is .*not a number.*llama default"):
        model_fields_from_hf(_bare("llama", **{key: bad}))
    if key == "rope_theta":
        form = hf_config("qwen3", form="rope_parameters", rope_parameters={"rope_type": "default", "rope_theta": bad})
        with pytest.raises(HFFormatError, match="rope_theta is"):
            model_fields_from_hf(form)


def test_a_window_caps_the_reach_a_rope_scaling_would_stretch(tmp_path):
    """A Mistral whose window equals its length, with a yarn scaling in its config.json: transformers attends
    within the window past it, longctx fully, so the reach is the window (it was original x factor = 1024,
    where logits differ from transformers' past 256); the length guard's message offers no RoPE flags."""
    from longctx.config.positions import model_reach
    from longctx.generate.prompts import _past_reach

    d = tmp_path / "hf"
    d.mkdir()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(_bare("mistral", sliding_window=256, max_position_embeddings=256,
                                                    num_key_value_heads=2, rope_scaling=yarn)))
    reach = model_reach(load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=256"]).model)
    assert (reach.positions, reach.window) == (256, 256) and "sliding window" in reach.said()
    said = _past_reach("prompt 1", 600, reach, 10)
    assert "256 positions" in said and "rope_scaling" not in said and "--allow-extrapolation" not in said
    plain = d.parent / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(_bare("mistral", sliding_window=256, max_position_embeddings=256,
                                                        num_key_value_heads=2)))
    reach = model_reach(load_config(overrides=[f"--model.init_from=hf:{plain}", "--train.seq_len=256"]).model)
    assert (reach.positions, reach.window) == (256, 0)  # (the window is the length: nothing capped)
