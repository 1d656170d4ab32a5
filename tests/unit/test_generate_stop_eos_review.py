"""Two inputs of `longctx generate` read wrong (review, 2026-12-02): a --stop holding a special token's text
among other text was refused by the output writer, after the weights had loaded (the docs promise bad input
before any weight is read); a config.json eos_token_id list holding null raised a TypeError."""

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from longctx.data.tokenizer import load_tokenizer
from longctx.errors import ConfigError
from longctx.generate.loading import eos_ids


@pytest.fixture
def hf_dir(tmp_path):
    """A Llama config.json alone (nothing before the weights reads more) and a tokenizer with special tokens."""
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0, eos_token_id=[None, 27])
    (tmp_path / "config.json").write_text(json.dumps(config))
    t = Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(26)} | {"<unk>": 26}, merges=[], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    t.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_a_stop_holding_a_special_token_is_refused_before_the_weights(hf_dir):
    from longctx.cli import build_parser
    from longctx.generate import cli

    args, rest = build_parser("generate").parse_known_args([
        "generate", "--checkpoint", f"hf:{hf_dir}", "--tokenizer", str(hf_dir / "tokenizer.json"),
        "--prompt", "abc", "--max-new-tokens", "4", "--stop", "x<|im_end|>"])
    with pytest.raises(ConfigError, match="holds the special token '<\\|im_end\\|>'"):
        cli.prepare(args, rest)  # (prepare reads no weight: a refusal after it came after the model loaded)


def test_a_null_among_the_eos_ids_is_left_out(hf_dir):
    assert eos_ids(f"hf:{hf_dir}", load_tokenizer(str(hf_dir / "tokenizer.json"))) == [27]
