"""`longctx bench decode --prompts`: a prompt holding a lone surrogate (a JSON "\\ud800" escape without its pair)
is one error before any model loads, as `longctx generate` refuses it (the byte tokenizer read it as '?' without a
word; a Hugging Face tokenizer's encode raised a traceback)."""

from types import SimpleNamespace

import pytest

from longctx.bench.decode import _read_prompts
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import ConfigError


def test_a_lone_surrogate_in_a_bench_decode_prompt_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "abc\\ud800def"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"prompt 2 holds U\+D800 at character 3, a lone surrogate"):
        _read_prompts(SimpleNamespace(prompts=str(path), target="none"), ByteTokenizer(), "byte")
    path.write_text('{"prompt": "caf\\u00e9 \\ud83d\\ude00"}\n', encoding="utf-8")  # (a pair: one character)
    got = _read_prompts(SimpleNamespace(prompts=str(path), target="none"), ByteTokenizer(), "byte")["prompts"]
    assert bytes(got[0]).decode("utf-8") == "caf\u00e9 \U0001F600"
