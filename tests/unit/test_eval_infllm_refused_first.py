"""`longctx eval --context-memory infllm` with a setting the memory cannot take is refused before the text is
read: before the default corpus is built (the first run of a passkey eval tokenized the standard library
into a store, 11.5 s and 29,751 samples with the byte tokenizer, longer with a model's BPE) or a --data
file is tokenized, as docs/eval.md says ("refused before work"). The memory's checks need only the
flags and the model's config."""

import json

import pytest

from longctx.errors import ConfigError

INFLLM = ("--mode", "generate", "--context-memory", "infllm", "--infllm-window", "64", "--infllm-block", "16",
          "--infllm-init", "4", "--infllm-positions", "shared")


@pytest.fixture
def hf_dir(tmp_path):
    """A Llama config.json alone (eval's checks read no weights)."""
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("flags, said", [
    (("--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0"), "drop --model.rope_ms_poe"),
    (("--batch", "2"), "drop --batch 2"),
    (("--infllm-window", "224"), "--infllm-window 224 is larger than the 200-token sequences"),
    (("--infllm-window", "256", "--infllm-block", "64"), "positions, past the"),
])
def test_the_memorys_errors_come_before_the_text_is_read(hf_dir, monkeypatch, flags, said):
    from longctx.cli import build_parser
    from longctx.eval import request

    def read(*a, **k):
        raise AssertionError("the eval's text was read (the default corpus built) before the memory's checks")

    monkeypatch.setattr(request, "_load_source", read)
    args, rest = build_parser("eval").parse_known_args(["eval", "--checkpoint", f"hf:{hf_dir}", "--tokenizer", "byte",
                                                        "--task", "passkey", "--lengths", "200", *INFLLM, *flags])
    with pytest.raises(ConfigError) as e:
        request.prepare(args, rest, 1)
    assert said in " ".join(str(e.value).split()), str(e.value)
