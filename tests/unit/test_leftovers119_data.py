"""Leftovers of the 118 round in the .jsonl encoding check and the tokenizer digest (helper jsonl): a UTF-8 unit led
by NUL lines was skipped whole as UTF-16, and bytes that fit UTF-16 as well were called UTF-32 (a guess without a
byte-order mark now needs a JSON start over several code units); a byte-order mark before a blank line (two files
joined) was a bad line; the missing-field hint read records of UTF-16 units and UTF-16 lines the build skipped; the
tokenizer digest's pre-check missed end-of-document strings written JSON-escaped (docs/data.md)."""

import codecs
import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.data import tokenizer as tokenizer_module
from longctx.data.builder import readers
from longctx.data.builder.field_hint import missing_field_hint
from longctx.data.builder.line_ends import wide_encoding
from longctx.data.tokenizer import HFTokenizer, tokenizer_digest

RECORDS = "".join(json.dumps({"text": f"document {i} " + "word " * 20}) + "\n" for i in range(50))


def _read(path, name="x.jsonl"):
    skipped, damaged = Counter(), []
    docs = list(readers.iter_file(path, name, "text", skipped, damaged))
    return docs, skipped, damaged


# -- 1a. a UTF-8 unit whose first lines hold NUL bytes ----------------------------------------------------------------

@pytest.mark.parametrize("lead", [b"\x00\n\x00\n", b"\x00\x00\n\x00\x00\n", b"\n\x00\n\x00\n"])
def test_a_utf8_jsonl_led_by_nul_lines_reads_its_records(tmp_path, lead):
    """b'\\x00\\n\\x00\\n{"text"...' (a padded or corrupt file) fits the UTF-16 zero pattern in its first 4 bytes:
    the whole file was skipped as UTF-16 (its 50 records lost); the NUL lines are bad lines, the records read."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(lead + RECORDS.encode())
    docs, skipped, damaged = _read(path)
    assert damaged == [] and len(docs) == 50, (skipped, damaged)
    assert set(skipped) == {"bad_json_line"} and docs[0].text.startswith("document 0 ")


# -- 1b. a guess without a byte-order mark ---------------------------------------------------------------------------

@pytest.mark.parametrize("head, expected", [
    (b"X\x00\x00\x00", None),  # 'X' U+0000 in UTF-16LE or 'X' in UTF-32LE: was "UTF-32"
    (b"X\x00\x00\x00Y\x00\x00\x00Z\x00\x00\x00W\x00\x00\x00", None),  # no JSON start: was "UTF-32"
    (b"{\x00\x00\x00", None),  # one UTF-32 code unit: too little to tell (was "UTF-32")
    (b"\x00\n\x00\n{\"text\": 1}", None),  # 1a's (was "UTF-16")
    (b"\x00{\x00\x00", None),  # '{' U+0000 in UTF-16BE: no JSON
    (b'{\x00\x00\x00"\x00t\x00e\x00x\x00t\x00', None),  # '{' U+0000 '"text' in UTF-16LE (was "UTF-32")
    ('{"text": 1}'.encode("utf-16-le"), "UTF-16"),
    ('{"text": 1}'.encode("utf-16-be"), "UTF-16"),
    ('\r\n \r\n[{"t": 1}]'.encode("utf-16-be"), "UTF-16"),
    ('{"文本": "段落"}'.encode("utf-16-le"), "UTF-16"),  # (a key not in ASCII: its punctuation tells)
    ('{"text": 1}'.encode("utf-32-le"), "UTF-32"),
    ('\n{"text": 1}'.encode("utf-32-be"), "UTF-32"),
    (codecs.BOM_UTF16_LE + "X".encode("utf-16-le"), "UTF-16"),  # a byte-order mark is decisive
    (codecs.BOM_UTF16_BE + b"\x00", "UTF-16"),
    (codecs.BOM_UTF32_BE + "X".encode("utf-32-be"), "UTF-32"),
    (codecs.BOM_UTF8 + '{"text": 1}'.encode("utf-16-le"), None),  # (UTF-8's own: then the lines are bad lines)
    (b'{"text": "a"}', None),
    (b"", None),
])
def test_wide_encoding_guesses_only_from_a_json_start(head, expected):
    assert wide_encoding(head) == expected


def test_a_utf16_file_whose_first_record_ends_in_a_nul_character_is_not_called_utf32(tmp_path):
    """'{' then U+0000 in UTF-16LE reads b'{\\x00\\x00\\x00', UTF-32LE's zero pattern: it was skipped as UTF-32 and
    the hint said iconv -f UTF-32, which garbles it. No guess now: its lines are bad lines."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(("{\x00\n" + RECORDS).encode("utf-16-le"))
    docs, skipped, damaged = _read(path)
    assert docs == [] and "utf32_file" not in skipped and damaged == [], skipped


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_a_wide_jsonl_whose_first_record_is_short_is_still_one_skip(tmp_path, encoding):
    """'{}' then records: the head reads on past the first non-blank line (375f4889's count of 4 ASCII characters
    could not guess from '{}' alone; test_review119b reads its next character too)."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(("{}\n" + RECORDS).encode(encoding))
    docs, skipped, damaged = _read(path)
    assert docs == [] and len(skipped) == 1 and damaged == ["x.jsonl"], skipped


# -- 1c. a byte-order mark where two files were joined ---------------------------------------------------------------

@pytest.mark.parametrize("blank", ["\n", "\r\n", " \n"])
def test_a_utf8_byte_order_mark_before_a_blank_line_is_a_blank_line(tmp_path, blank):
    """`cat a.jsonl b.jsonl` where b.jsonl was saved with a BOM and starts with a blank line: the BOM's line was
    counted as an unparsable JSON line; a BOM at a line's start is dropped, the line is blank."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(RECORDS.encode() + codecs.BOM_UTF8 + (blank + RECORDS).encode())
    docs, skipped, _ = _read(path)
    assert not skipped and len(docs) == 100, skipped


def test_a_utf8_byte_order_mark_at_a_joined_line_start_reads_its_record(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(RECORDS.encode() + codecs.BOM_UTF8 + RECORDS.encode())
    docs, skipped, _ = _read(path)
    assert not skipped and [d.text for d in docs[50:]] == [d.text for d in docs[:50]]
    assert docs[50].name == "x.jsonl:51" and not docs[50].text.startswith("\ufeff")


def _fields_file(tmp_path, name, records, encoding="utf-8", bom=b""):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_bytes(bom + "".join(json.dumps(r) + "\n" for r in records).encode(encoding))
    return path


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", codecs.BOM_UTF16_BE),
                                           ("utf-32-le", codecs.BOM_UTF32_LE)])
def test_the_missing_field_hint_reads_no_record_of_a_wide_line_after_utf8_lines(tmp_path, encoding, bom):
    """A UTF-8 file with a UTF-16 file joined after it: the build counts the BOM's line as not UTF-8 and reads no
    record after it; the hint parsed that line's bytes (json.loads takes UTF-16) and named a field the build never
    saw."""
    path = _fields_file(tmp_path, "x.jsonl", [{"content": "a"}] * 3)
    path.write_bytes(path.read_bytes() + bom + json.dumps({"secret": "b"}).encode(encoding) + b"\n")
    docs, skipped, _ = _read(path)
    assert docs == [] and skipped["missing_text_field"] == 3 and "secret" not in str(skipped)
    hint = missing_field_hint([str(path)], dict(skipped), {"--text-field": "text"})
    assert "content" in hint and "secret" not in hint, hint


# -- 1d. the missing-field hint reads a UTF-16 / UTF-32 unit as the build does ---------------------------------------

@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-16"])
def test_the_missing_field_hint_skips_a_wide_unit_as_the_build_does(tmp_path, encoding):
    """The build skips a UTF-16 unit whole; the hint's json.loads(bytes) read its first line as a record (UTF-16
    without a mark: json.loads' own detection) and named its fields, which no record the build read has."""
    inputs = tmp_path / "in"
    _fields_file(inputs, "a.jsonl", [{"content": "a", "id": i} for i in range(3)])
    _fields_file(inputs, "b.jsonl", [{"body": "b", "lang": "x"}] * 3, encoding)
    skipped, damaged = Counter(), []
    for name in ("a.jsonl", "b.jsonl"):
        assert list(readers.iter_file(inputs / name, name, "text", skipped, damaged)) == []
    assert damaged == ["b.jsonl"], skipped
    hint = missing_field_hint([str(inputs)], dict(skipped), {"--text-field": "text"})
    assert "content, id" in hint and "body" not in hint and "lang" not in hint, hint


def test_the_missing_field_hint_reads_a_utf8_unit_s_bom_lines(tmp_path):
    path = _fields_file(tmp_path, "x.jsonl", [{"content": "a"}], bom=codecs.BOM_UTF8)
    path.write_bytes(path.read_bytes() + codecs.BOM_UTF8 + b'{"body": "b"}\n')
    hint = missing_field_hint([str(path)], {"missing_text_field": 2}, {"--text-field": "text"})
    assert "fields: content, body." in hint, hint


# -- 2. the tokenizer digest's pre-check and JSON escapes ------------------------------------------------------------

def _word_and_special(folder, escape=None, first_special=False) -> Path:
    """A tokenizer.json with '<|endoftext|>' a plain word and '</s>' its special token (the rule of 7f273663 chooses
    '</s>', where the first candidate in the vocabulary was '<|endoftext|>'), or with `first_special` the other way
    round (the choice unchanged); `escape` rewrites the file's JSON text, as other JSON writers spell it."""
    plain, special = ("</s>", "<|endoftext|>") if first_special else ("<|endoftext|>", "</s>")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, plain: 2, f"w{random.random()}": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # (a new word: content no earlier digest was remembered for)
    tok.add_special_tokens([special])
    folder.mkdir()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    if escape:
        path.write_text(escape(path.read_text()))
    return path


GO_STYLE = lambda text: text.replace("<", "\\u003c").replace(">", "\\u003e")  # noqa: E731 (Go's encoding/json)
UPPER_HEX = lambda text: text.replace("<", "\\u003C").replace(">", "\\u003E").replace("|", "\\u007C")  # noqa: E731
SLASHES = lambda text: text.replace("/", "\\/")  # noqa: E731 (PHP's json_encode)
LETTERS = lambda text: text.replace("<|endoftext|>", "<|end\\u006ffte\\u0078t|>")  # noqa: E731


@pytest.mark.parametrize("escape", [GO_STYLE, UPPER_HEX, SLASHES, LETTERS], ids=["go", "upper", "slash", "letters"])
def test_the_digest_covers_the_end_token_choice_of_an_escaped_tokenizer_json(tmp_path, escape):
    """The pre-check looked for the candidates' raw bytes: escaped, fewer than two were 'in the file', the choice was
    not recorded, and a store built under the old rule (the plain word as EOS) was taken for a new one."""
    path = _word_and_special(tmp_path / "t", escape)
    tok = HFTokenizer(path)
    assert tok.eos_id == tok.special_tokens()["</s>"]  # (the library reads the escaped file: '</s>' chosen)
    assert tokenizer_digest(str(path)) != hashlib.sha256(path.read_bytes()).hexdigest()
    plain = _word_and_special(tmp_path / "plain")
    assert tokenizer_digest(str(plain)) != hashlib.sha256(plain.read_bytes()).hexdigest()


@pytest.mark.parametrize("escape", [None, GO_STYLE, SLASHES])
def test_an_escaped_tokenizer_whose_choice_did_not_change_keeps_its_digest(tmp_path, escape):
    path = _word_and_special(tmp_path / "t", escape, first_special=True)
    assert tokenizer_digest(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tokenizer_json_with_one_candidate_and_no_escape_is_not_parsed(tmp_path, monkeypatch):
    """The pre-check stays a byte search: only a file that may hold two candidates (raw or escaped) is parsed."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a\\/b": 1, f"w{random.random()}": 2}, unk_token="[UNK]"))
    tok.add_special_tokens(["</s>"])
    (tmp_path / "t").mkdir()
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    parsed = []
    monkeypatch.setattr(tokenizer_module, "_eos_record", lambda *a: parsed.append(a) or b"")
    tokenizer_digest(str(tmp_path / "t"))
    assert parsed == []
