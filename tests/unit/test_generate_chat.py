"""`longctx generate --chat` (data/chat_template.py): a SmolLM2-135M-Instruct-like tokenizer (its special
tokens and its real chat template in tokenizer_config.json, or in chat_template.jinja) turns a
conversation into the same token ids as transformers' apply_chat_template(add_generation_prompt=True),
and a tiny random model then decodes, greedily, the same tokens as transformers' generate on them.
Bad chat input is one clear error each, before any weight is read."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.generate.cli import prepare  # noqa: E402

# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json carries it
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
IM_END = 2
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in Python."},
     {"role": "user", "content": "def f(x):"},
     {"role": "assistant", "content": "return x + 1"},
     {"role": "user", "content": "And a class?"}],
]


def _chat_tokenizer(folder, jinja_file=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def f(x):\n    return x + 1\n", "You are a helpful AI assistant named SmolLM\n",
            "system user assistant What is 2 + 2? class A:\n    pass\n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    # a BOS the tokenizer adds to plain text (as Llama's do): a rendered chat must not get a second one
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
              "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "model_max_length": 8192}
    if jinja_file:
        (folder / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    else:
        config["chat_template"] = SMOLLM2_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("instruct")
    d, ref = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=IM_END, bos_token_id=1))
    _chat_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END, "bos_token_id": 1}))
    return d, ref


def _prepare(*argv):
    args, rest = build_parser("generate").parse_known_args(["generate", *argv])
    return prepare(args, rest)


def _theirs_ids(folder, messages):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _messages_file(path, conversations):
    path.write_text("".join(json.dumps({"messages": m, "id": i}) + "\n" for i, m in enumerate(conversations)))
    return path


@pytest.mark.parametrize("jinja_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
def test_prompt_ids_equal_apply_chat_template(tmp_path, jinja_file):
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder, jinja_file)
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    request = _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompts",
                    str(_messages_file(tmp_path / "m.jsonl", CONVERSATIONS)))
    for p, messages in zip(request.prompts, CONVERSATIONS):
        assert p["ids"] == _theirs_ids(folder, messages)
        assert p["text"].startswith("<|im_start|>") and p["text"].endswith("<|im_start|>assistant\n")
    # a plain prompt with --chat is one user message
    [p] = _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompt", "What is 2 + 2?").prompts
    assert p["ids"] == _theirs_ids(folder, CONVERSATIONS[0])


def test_greedy_chat_equals_transformers(instruct, tmp_path):
    d, ref = instruct
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "longctx", "generate", "--checkpoint", f"hf:{d}", "--chat",
                        "--prompts", str(_messages_file(tmp_path / "m.jsonl", CONVERSATIONS)), "--max-new-tokens",
                        "24", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for line, messages in zip(lines, CONVERSATIONS):
        ids = _theirs_ids(d, messages)
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=IM_END,
                                  pad_token_id=IM_END)[0, len(ids):].tolist()
        if IM_END in theirs:
            theirs = theirs[:theirs.index(IM_END)]
        assert line["prompt_tokens"] == len(ids) and line["tokens"] == theirs and theirs


@pytest.mark.parametrize("row, flags, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, [], 'has "messages": a conversation is turned into a prompt '
                                                            "by the tokenizer's chat template; pass --chat"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, ["--chat"],
     "message 1 has 'tool_calls', which the chat template is not given"),
    ({"messages": [{"role": "user"}]}, ["--chat"], 'message 1 needs a "content" string'),
    ({"messages": []}, ["--chat"], '"messages" must be a non-empty list'),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, ["--chat"], 'has both "prompt" and "messages"'),
])
def test_bad_chat_rows(tmp_path, row, flags, message):
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="line 1") as e:
        _prepare("--checkpoint", f"hf:{folder}", "--prompts", str(f), *flags)
    assert message in str(e.value)


def test_chat_without_a_template(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    with pytest.raises(ConfigError, match="has no chat template"):
        _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompt", "hi")
    bare = tmp_path / "bare"  # (weights without a tokenizer of their own take --tokenizer byte)
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    with pytest.raises(ConfigError, match="the byte tokenizer has none"):
        _prepare("--checkpoint", f"hf:{bare}", "--chat", "--prompt", "hi", "--tokenizer", "byte")


def test_template_errors_are_said(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder, jinja_file=True)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    f = _messages_file(tmp_path / "m.jsonl", [[{"role": "assistant", "content": "hi"}]])
    with pytest.raises(ConfigError, match="could not render the messages: Conversations must start with a user"):
        _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompts", str(f))


def test_templates_that_test_for_tools_render_as_transformers(tmp_path):
    """transformers passes tools=None and documents=None: a template guarding on them must not see them
    as defined (an undefined variable `is not none` in Jinja); a Python error inside is said, not raised."""
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder, jinja_file=True)
    (folder / "chat_template.jinja").write_text(
        "{%- if tools is not none %}[TOOLS]{{ tools|tojson }}[/TOOLS]{%- endif %}"
        "{%- if documents is not none %}<docs>{%- endif %}"
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    [p] = _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompt", "What is 2 + 2?").prompts
    assert "[TOOLS]" not in p["text"] and "<docs>" not in p["text"]
    assert p["ids"] == _theirs_ids(folder, CONVERSATIONS[0])
    (folder / "chat_template.jinja").write_text("{{ messages|tojson(indent=undefined_thing) }}")
    with pytest.raises(ConfigError, match="could not render the messages"):
        _prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompt", "hi")
