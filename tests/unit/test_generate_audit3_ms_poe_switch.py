"""`longctx generate --model.rope_ms_poe_min=1.5` (or _max, _order, _skip_layers) without
`--model.rope_ms_poe=true` is one error before work. Before this audit Ms-PoE stayed off and the run
decoded with plain RoPE, its tokens those of the model without the option the command line asked for,
without a word (train's config report names such keys as ignored; generate said nothing). A key given
its default value changes nothing and is no mistake; with the switch, the keys apply as before."""

import json

import pytest

from longctx.errors import ConfigError


@pytest.fixture
def hf_dir(tmp_path):
    """A Llama config.json alone: generate's checks read no weights."""
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _generate(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--tokenizer",
                                                            "byte", "--max-new-tokens", "4", "--prompt", "hello",
                                                            *argv])
    return prepare(args, rest)


@pytest.mark.parametrize("override", ["--model.rope_ms_poe_min=1.5", "--model.rope_ms_poe_max=3",
                                      "--model.rope_ms_poe_order=index", "--model.rope_ms_poe_skip_layers=1"])
def test_an_ms_poe_setting_without_the_switch_is_refused(hf_dir, override):
    key = override.split("=")[0].removeprefix("--")
    with pytest.raises(ConfigError) as e:
        _generate(hf_dir, override)
    said = " ".join(str(e.value).split())
    assert f"{key}" in said and "--model.rope_ms_poe=true" in said, said


def test_the_switch_or_a_default_value_runs(hf_dir):
    on = _generate(hf_dir, "--model.rope_ms_poe=true", "--model.rope_ms_poe_min=1.5", "--model.rope_ms_poe_max=3",
                   "--model.rope_ms_poe_order=index", "--model.rope_ms_poe_skip_layers=1")
    m = on.cfg.model
    assert (m.rope_ms_poe, m.rope_ms_poe_min, m.rope_ms_poe_max, m.rope_ms_poe_order, m.rope_ms_poe_skip_layers) == \
        (True, 1.5, 3, "index", 1)
    assert not _generate(hf_dir, "--model.rope_ms_poe_min=1.2").cfg.model.rope_ms_poe  # (its default: no mistake)
    assert not _generate(hf_dir, "--model.rope_ms_poe=false").cfg.model.rope_ms_poe
