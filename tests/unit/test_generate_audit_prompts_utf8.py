"""A --prompts file holding bytes that are not UTF-8 (a Latin-1 export, say) is one error naming its line,
before any weight is read, as a lone surrogate is (it was a UnicodeDecodeError traceback); its line ends
("\\r\\n", "\\r") still read as "\\n", as the text mode read them."""

import json
from types import SimpleNamespace

import pytest

from longctx.errors import ConfigError
from longctx.generate.prompts import read_prompts


def _read(path):
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=False))


def test_a_prompts_file_that_is_not_utf8_is_one_error_naming_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\r\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"line 3 is not UTF-8 text \(byte 0xe9"):
        _read(path)
    path.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r{"prompt": "caf\xc3\xa9", "id": 2}\n')
    assert [p["text"] for p in _read(path)] == ["a", "b", "caf\u00e9"]
    path.write_text(json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert _read(path)[0]["text"] == "x\u2028y"
