"""Prompt ids and output text against transformers (audit of data/chat_template.py, generate/output.py): a chat
template's special tokens read as transformers reads them (special_tokens_map.json of a tokenizer
saved in the older layout), the template found from --tokenizer DIR, and --echo's text keeping the
first space of a SentencePiece-style continuation (transformers' text-generation pipeline, vLLM)."""

import json
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.data.tokenizer import load_tokenizer  # noqa: E402
from longctx.generate.cli import prepare  # noqa: E402
from longctx.generate.output import Output  # noqa: E402

# Llama-3's chat template, reduced: it writes {{ bos_token }} itself
LLAMA3 = ("{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS = 0
MESSAGES = [{"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "What is 2 + 2?"}]


def _llama3_folder(folder, config: dict, special_tokens_map: dict | None):
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["You are a helpful assistant. system user What is 2 + 2?\n"] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", BOS)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "chat_template": LLAMA3, **config}))
    if special_tokens_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    (folder / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    return folder


def _ours(folder, *argv):
    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{folder}", *argv])
    return prepare(args, rest).prompts


def _theirs(folder, messages):
    out = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _added(tokens):
    return {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, t in enumerate(tokens)}


LAYOUTS = {
    # bos_token only in special_tokens_map.json (a tokenizer saved in the older layout)
    "map-only": ({"eos_token": "<|eot_id|>"}, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    # both, differing: transformers takes the map's
    "map-over-config": ({"bos_token": "<|end_of_text|>", "eos_token": "<|eot_id|>"},
                        {"bos_token": {"content": "<|begin_of_text|>", "special": True}}),
    # the newer layout (added_tokens_decoder): transformers ignores special_tokens_map.json
    "newer-layout": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "added_tokens_decoder":
                      _added(SPECIALS)}, {"bos_token": "<|end_of_text|>"}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chat_special_tokens_read_as_transformers_reads_them(tmp_path, layout):
    """The template's {{ bos_token }}: before, tokenizer_config.json's alone, so with the BOS only in
    special_tokens_map.json the prompt lost its BOS (the model's first token), silently."""
    config, special_map = LAYOUTS[layout]
    folder = _llama3_folder(tmp_path / "tok", config, special_map)
    [p] = _ours(folder, "--chat", "--prompts", str(_jsonl(tmp_path, MESSAGES)))
    assert p["ids"] == _theirs(folder, MESSAGES)
    assert p["ids"][0] == BOS and p["ids"].count(BOS) == 1


def test_chat_template_found_from_a_tokenizer_directory(tmp_path):
    """--tokenizer DIR (a folder holding tokenizer.json, as HFTokenizer takes it): the template beside
    it, as with --tokenizer DIR/tokenizer.json (before: looked for in DIR's parent)."""
    folder = _llama3_folder(tmp_path / "tok", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, None)
    for spec in (folder, folder / "tokenizer.json"):
        [p] = _ours(folder, "--tokenizer", str(spec), "--chat", "--prompts", str(_jsonl(tmp_path, MESSAGES)))
        assert p["ids"] == _theirs(folder, MESSAGES)


def _jsonl(tmp_path, messages):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    return path


def _sentencepiece(folder):
    """A Llama-2 / Mistral-style tokenizer.json: '▁' for spaces, byte fallback, BOS added, and the
    decoder's Strip that drops a decoded text's first space."""
    folder.mkdir()
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["Once upon a time there was a cat.\n"] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.mark.parametrize("stop", [None, "was"])
def test_echo_keeps_the_first_space_of_the_continuation(tmp_path, stop):
    """--echo: prompt + continuation as transformers' pipeline reads it (the whole decoded). Before, the
    continuation decoded alone lost its first space: 'Once upon atime there was a cat'."""
    folder = _sentencepiece(tmp_path / "sp")
    tok = load_tokenizer(str(folder / "tokenizer.json"))
    prompt = "Once upon a"
    ids = [int(t) for t in tok.encode(prompt, add_special_tokens=True)]
    new = [int(t) for t in tok.encode("time there was a cat")]
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    whole = theirs.decode(ids + new, skip_special_tokens=True)
    continuation = whole[len(theirs.decode(ids, skip_special_tokens=True)):]
    assert continuation == " time there was a cat"
    result = SimpleNamespace(tokens=new, prompt_tokens=len(ids), finish_reason="stop" if stop else "length",
                             prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0)
    lines = {}
    for echo in (True, False):
        out = Output(tok, [stop] if stop else [], str(tmp_path / f"{echo}.jsonl"), 2, 8, True, echo=echo)
        out.write({"text": prompt, "ids": ids}, result, speculative=False)
        out.close()
        lines[echo] = json.loads((tmp_path / f"{echo}.jsonl").read_text())["text"]
    want = continuation[:continuation.index(stop)] if stop else continuation
    assert lines[True] == prompt + want
    # without --echo the same continuation, first space kept (as transformers' pipeline and vLLM give it; until
    # 2026-12-03 the new ids decoded alone, which the stop strings were checked on: tests/unit/test_stop_after_prompt)
    assert lines[False] == want


def test_stream_holds_a_stop_string_across_a_partial_character(capsys):
    """The terminal never shows what the JSON text cuts: with a stop string 'time é' and 'é' in two
    tokens (bytes, or byte-fallback pieces), 'time ' + a partial 'é' (decoded '\ufffd') no longer
    ended in a tail the stop string begins with, so 'time ' was shown, then cut from the text."""
    from longctx.generate.output import StopStrings, Stream

    tok = load_tokenizer("byte")
    stops = ["time é"]
    stream, stop = Stream(tok, stops), StopStrings(tok, stops)
    tokens = []
    for t in map(int, tok.encode("Once upon a time é cat")):
        tokens.append(t)
        stream(0, t)
        if stop(0, tokens):
            break
    text = stop.cut(tok.decode(tokens))
    stream.finish(text)
    assert text == "Once upon a " and capsys.readouterr().err == text + "\n"
