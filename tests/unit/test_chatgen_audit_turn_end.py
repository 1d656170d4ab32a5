"""`longctx generate --chat` stops at the end of an assistant's turn: the tokenizer's eos_token (its
tokenizer_config.json's, the `eos_token` the chat template reads: transformers' tokenizer.eos_token_id) is a stop
beside the model's EOS ids, as vLLM stops there. An instruct model whose generation_config.json is absent and whose
config.json names no EOS, or a base model's end of text only, stopped at the tokenizer's end-of-document token alone:
the row ran past <|im_end|> (<|eot_id|>) into a next turn the model made up."""

import json

import pytest

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.generate.cli import prepare  # noqa: E402

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
    "m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
QWEN = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", QWEN_TEMPLATE, None)
LLAMA3 = (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
          "<|eot_id|>", LLAMA3_TEMPLATE, "<|begin_of_text|>")


def _folder(tmp_path, family, specials, eos_token, template, bos, config_eos=None, generation_eos=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path / "model"
    d.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["system user assistant You are a helpful assistant. What is 2 + 2?\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos_token,
        "chat_template": template}))
    extra = {} if config_eos is None else {"eos_token_id": config_eos}
    (d / "config.json").write_text(json.dumps(test_hf.hf_config(family, **extra)))
    if generation_eos is not None:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return d


def _request(d, *flags):
    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--prompt",
                                                            "What is 2 + 2?", *flags])
    return prepare(args, rest)


@pytest.mark.parametrize("family, model, config_eos", [
    ("qwen2", QWEN, None),      # no generation_config.json, no eos_token_id: the tokenizer's <|endoftext|> alone
    ("qwen2", QWEN, 0),         # a base model's end of text only
    ("llama", LLAMA3, 1),       # Llama-3-Instruct's first config.json: <|end_of_text|>, not <|eot_id|>
], ids=["qwen-none", "qwen-end-of-text", "llama3-end-of-text"])
def test_the_end_of_an_assistants_turn_ends_a_chat_generation(tmp_path, family, model, config_eos):
    d = _folder(tmp_path, family, *model, config_eos=config_eos)
    turn_end = transformers.AutoTokenizer.from_pretrained(str(d)).eos_token_id  # (<|im_end|>, <|eot_id|>)
    plain = _request(d)
    assert turn_end not in plain.eos_ids  # (the model's EOS alone, as without --chat before)
    chat = _request(d, "--chat")
    assert chat.eos_ids == [*plain.eos_ids, turn_end]
    assert any(f"eos_token {model[1]} (id {turn_end})" in note for note in chat.notes)


def test_a_turn_end_among_the_models_eos_ids_is_not_added_again(tmp_path):
    d = _folder(tmp_path, "llama", *LLAMA3, config_eos=1, generation_eos=[1, 4])  # (Llama-3.1's list holds it)
    chat = _request(d, "--chat")
    assert chat.eos_ids == [1, 4] and not any("eos_token" in note for note in chat.notes)


def test_ignore_eos_adds_no_turn_end_and_says_none(tmp_path):
    d = _folder(tmp_path, "qwen2", *QWEN)
    chat = _request(d, "--chat", "--ignore-eos")  # (the run ends no row on any of them: cli.py _run)
    assert chat.eos_ids == [0] and not any("eos_token" in note for note in chat.notes)
