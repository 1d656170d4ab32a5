"""Review of 375f4889 (jsonl encodings and the tokenizer digest). A UTF-16 / UTF-32 .jsonl without a byte-order mark
whose first key is long and not ASCII (CJK, emoji) held fewer than 4 ASCII characters in its first 64 bytes: no
guess, each of its lines one bad line, the file not named and no iconv hint (before 375f4889 it was one skip); the
guess now takes JSON's next character too. The tokenizer digest's escape search is checked against a JSON parse
(its speed on a CJK vocabulary written by json.dump is a figure in tokenizer.py, not a test: no timing is asserted)."""

import json
import random
from collections import Counter

import pytest

from longctx.data.builder import readers
from longctx.data.builder.line_ends import wide_encoding
from longctx.data.tokenizer import _EOS_CANDIDATES, _candidates_in

LONG_KEY = "文本标题" * 8  # 32 characters: 64 bytes of UTF-16, 128 of UTF-32, with no ASCII in them


def _read(path, name="x.jsonl"):
    skipped, damaged = Counter(), []
    docs = list(readers.iter_file(path, name, "text", skipped, damaged))
    return docs, skipped, damaged


@pytest.mark.parametrize("encoding, reason", [("utf-16-le", "utf16_file"), ("utf-16-be", "utf16_file"),
                                              ("utf-32-le", "utf32_file"), ("utf-32-be", "utf32_file")])
@pytest.mark.parametrize("key", [LONG_KEY, "😀" * 20], ids=["cjk", "emoji"])  # (emoji: surrogate pairs)
def test_a_wide_jsonl_whose_first_key_is_long_and_not_ascii_is_one_skip(tmp_path, encoding, reason, key):
    """{"文本标题...": ...} in UTF-16 without a mark: 2 ASCII characters in its first 64 bytes, so it was read as
    UTF-8, 20 lines counted as 20 bad lines (not UTF-8 / unparsable) and the file not named with the damaged ones."""
    path = tmp_path / "x.jsonl"
    lines = "".join(json.dumps({key: "段落" * 30, "text": "x"}, ensure_ascii=False) + "\n" for _ in range(20))
    path.write_bytes(lines.encode(encoding))
    docs, skipped, damaged = _read(path)
    assert docs == [] and dict(skipped) == {reason: 1} and damaged == ["x.jsonl"], skipped


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_a_wide_jsonl_of_one_empty_record_is_one_skip(tmp_path, encoding):
    """'{}' alone (a file of one empty object): 3 ASCII characters, no guess, 2 bad lines."""
    path = tmp_path / "x.jsonl"
    path.write_bytes("{}\n".encode(encoding))
    docs, skipped, damaged = _read(path)
    assert docs == [] and len(skipped) == 1 and sum(skipped.values()) == 1 and damaged == ["x.jsonl"], skipped


@pytest.mark.parametrize("head, expected", [
    (('{"' + LONG_KEY).encode("utf-16-le")[:64], "UTF-16"),  # (the head cut inside the key)
    (('{"' + LONG_KEY).encode("utf-16-be")[:63], "UTF-16"),  # (cut inside a code unit)
    (('\n\n{ "' + "😀" * 20).encode("utf-16-le")[:65], "UTF-16"),  # (cut inside a surrogate pair)
    (('{"' + LONG_KEY).encode("utf-32-be")[:64], "UTF-32"),
    ("[1]".encode("utf-16-be"), "UTF-16"),
    ('[\t"a"]'.encode("utf-32-le"), "UTF-32"),
    ("{}".encode("utf-16-le"), "UTF-16"),
    # no JSON start in that encoding: UTF-8 text after a stray zero byte, or a '{' that no key follows
    (b'{\x00"text": "a"}', None),
    (b'\x00{"text": "a"}', None),
    (b'{\x00' + "中文".encode(), None),
    ("{abcdefgh}".encode("utf-16-le"), "UTF-16"),  # (no JSON, but 4 ASCII characters: UTF-16 as before)
    ("{\n{".encode("utf-16-le"), None),  # (neither: 3 ASCII characters, no key after the `{`)
    ("[x]".encode("utf-16-le"), None),
    (b"{\x00", None),  # (the head ends before a next character: too little to tell)
    ('{"\x00"}'.encode("utf-16-le"), None),  # (U+0000: no JSON text, whatever follows the `{`)
], ids=lambda v: None if isinstance(v, str | None) else v[:12].hex())
def test_wide_encoding_reads_json_s_first_two_characters(head, expected):
    assert wide_encoding(head) == expected


# -- the tokenizer digest's escape search ------------------------------------------------------------------------------

def _escaped(rng, text: str) -> str:
    """`text` (in a JSON string) with some characters escaped as JSON writers do: \\uXXXX in either case, '/' as \\/."""
    out = []
    for c in text:
        roll = rng.random()
        if c == "/" and roll < 0.3:
            out.append("\\/")
        elif roll < 0.5:
            out.append(f"\\u{ord(c):04x}" if rng.random() < 0.5 else f"\\u{ord(c):04X}")
        else:
            out.append(json.dumps(c, ensure_ascii=False)[1:-1])
    return "".join(out)


@pytest.mark.parametrize("seed", range(4))
def test_the_escape_search_never_misses_a_candidate_a_parse_finds(seed):
    """A random tokenizer.json-like file: vocabulary words (CJK, ASCII, candidates and near misses such as '</S>'),
    some escaped, with CJK \\uXXXX escapes (json.dump's ensure_ascii) around them. The count is never under what
    the parsed strings hold (a parse-free search may count a candidate that an escaped backslash spells)."""
    rng = random.Random(seed)
    pieces = ["中", "文", "a", "b", "<", ">", "|", "/", "\\", "s", "</S>", "<|endof", "text|>", *_EOS_CANDIDATES]
    for _ in range(200):
        words = ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 12))]
        vocab = {w: i for i, w in enumerate(words)}
        data = "{" + ", ".join(f'"{_escaped(rng, w)}": {i}' for w, i in vocab.items()) + "}"
        assert json.loads(data) == vocab  # (the escapes are JSON's)
        held = sum(any(t in w for w in vocab) for t in _EOS_CANDIDATES)
        assert _candidates_in(data.encode()) >= held, data
        if "\\" not in "".join(vocab):  # (no backslash of the text's own: the count is exact)
            assert _candidates_in(data.encode()) == held, data
