"""Leftovers of the .jsonl readers' encoding handling (helper dataleft), each checked against what Python's codecs and
json read line by line (`_python_reads`):
(a) a UTF-16 / UTF-32 file of white space alone (no byte-order mark) counted each of its lines as a bad line, and
    with a mark it was skipped and named as a file to convert; a UTF-8 file of blank lines is no skip: neither is it.
(b) UTF-8 lines (blank, or records) before a UTF-16 / UTF-32 byte-order mark (files joined) counted the mark's line
    as not UTF-8 and every line after it as a bad line; the file is now one skip, named, as a UTF-16 file is.
(c) a UTF-8 byte-order mark inside a line (`cat a.jsonl b.jsonl`, a.jsonl without a final newline, b.jsonl saved
    with a mark) made a's last record and b's first one bad line: both are read now (named LINE and LINE.2)."""

import codecs
import json
from collections import Counter

import pytest

from longctx.data.builder import readers
from longctx.data.builder.inputs import read_inputs


def _records(start, n):
    return [{"text": f"document {i} " + "word " * 5} for i in range(start, start + n)]


def _jsonl(records, end="\n"):
    return "".join(json.dumps(r, ensure_ascii=False) + end for r in records)


def _read(path, name="x.jsonl"):
    skipped, damaged = Counter(), []
    docs = list(readers.iter_file(path, name, "text", skipped, damaged))
    return docs, dict(skipped), damaged


def _python_reads(data: bytes, codec: str) -> tuple[list, int]:
    """(records, bad lines) of `data` as Python reads it: decoded whole by `codec`, split into lines, each non-blank
    line a json.loads."""
    records, bad = [], 0
    for line in data.decode(codec).split("\n"):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                bad += 1
    return records, bad


# -- (a) white space alone in UTF-16 / UTF-32 ------------------------------------------------------------------------

WIDE = ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "utf-16", "utf-32"]  # (the last two with a mark)


@pytest.mark.parametrize("codec", WIDE)
@pytest.mark.parametrize("blank", [" \n\n \t\n", "\r\n\r\n", "\n", " "])
def test_a_wide_file_of_white_space_alone_is_no_skip(tmp_path, codec, blank):
    path = tmp_path / "x.jsonl"
    path.write_bytes(blank.encode(codec))
    assert _python_reads(path.read_bytes(), codec) == ([], 0)
    assert _read(path) == ([], {}, []), (codec, blank)


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-32-be", "utf-16"])
def test_white_space_past_the_first_mib_then_records_is_still_one_skip(tmp_path, codec):
    """The head reads no non-blank byte in its first MiB: the white space tells the encoding, the records after it
    make the file one to convert (each line was a bad line); white space alone to the end is no skip."""
    lead = "\n" * (300_000 if "16" in codec else 150_000)
    path = tmp_path / "x.jsonl"
    path.write_bytes(lead.encode(codec))
    assert _read(path) == ([], {}, [])
    path.write_bytes((lead + _jsonl(_records(0, 3))).encode(codec))
    assert _python_reads(path.read_bytes(), codec)[0] == _records(0, 3)
    family = "utf32_file" if "32" in codec else "utf16_file"
    assert _read(path) == ([], {family: 1}, ["x.jsonl"])


@pytest.mark.parametrize("data, bad", [(b"\x00" * 64, 1), (b"\x00\x00\x00\x00\n{}\n", 2)])
def test_zero_bytes_that_are_no_white_space_stay_bad_lines(tmp_path, data, bad):
    """A file of zero bytes (allocated, never written) is U+0000 in any encoding: a bad line, as it was; so is a
    NUL line before a UTF-8 record (here `{}`, no text field: one more skip)."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    docs, skipped, damaged = _read(path)
    assert docs == [] and skipped.get("bad_json_line") == 1 and sum(skipped.values()) == bad and damaged == []


def test_nul_lines_alone_are_blank_lines_in_utf16be(tmp_path):
    """b"\\0\\n\\0\\n" is two blank lines in UTF-16BE (docs/data.md): it holds nothing either way, no skip."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\x00\n\x00\n")
    assert _python_reads(path.read_bytes(), "utf-16-be") == ([], 0)
    assert _read(path) == ([], {}, [])


# -- (b) UTF-8 lines, then a UTF-16 / UTF-32 byte-order mark ---------------------------------------------------------

@pytest.mark.parametrize("codec, bom", [("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", codecs.BOM_UTF16_BE),
                                        ("utf-32-le", codecs.BOM_UTF32_LE), ("utf-32-be", codecs.BOM_UTF32_BE)])
@pytest.mark.parametrize("lead", ["\n", "\r\n\r\n", "  \n\n", _jsonl(_records(0, 3))])
def test_a_wide_part_after_utf8_lines_makes_the_file_one_named_skip(tmp_path, codec, bom, lead):
    """What a user expects of `cat blank.jsonl ps.jsonl` (PowerShell 5 writes UTF-16 with a mark): not hundreds of
    unparsable lines and no file named, but the file named once as one to convert, none of its records kept (as any
    damaged file's)."""
    wide = _jsonl(_records(10, 40))
    path = tmp_path / "in" / "x.jsonl"
    path.parent.mkdir()
    path.write_bytes(lead.encode() + bom + wide.encode(codec))
    with pytest.raises(UnicodeDecodeError):  # (Python's reading as UTF-8 stops at the mark, as a build may not)
        path.read_bytes().decode("utf-8")
    assert _python_reads(bom + wide.encode(codec), codec[:6])[0] == _records(10, 40)  # (the part, read alone)
    family = "utf32_file" if "32" in codec else "utf16_file"
    docs, skipped, damaged = _read(path)
    assert skipped == {family: 1} and damaged == ["x.jsonl"], skipped
    result = read_inputs([str(path)])
    assert result.docs == [] and {k: n for k, n in result.skipped.items() if n} == {family: 1}


@pytest.mark.parametrize("codec", ["utf-16", "utf-32"])
def test_a_wide_part_of_white_space_alone_after_records_is_no_skip(tmp_path, codec):
    path = tmp_path / "x.jsonl"
    path.write_bytes(_jsonl(_records(0, 3)).encode() + "\n \n".encode(codec))
    docs, skipped, damaged = _read(path)
    assert [d.text for d in docs] == [r["text"] for r in _records(0, 3)] and skipped == {} and damaged == []


# -- (c) a UTF-8 byte-order mark inside a line -----------------------------------------------------------------------

def test_files_joined_without_a_newline_keep_every_record(tmp_path):
    a, b = _jsonl(_records(0, 3)).rstrip("\n"), _jsonl(_records(3, 3))
    path = tmp_path / "x.jsonl"
    path.write_bytes(a.encode() + codecs.BOM_UTF8 + b.encode())
    python = _python_reads(path.read_bytes(), "utf-8")
    assert python == (_records(0, 2) + _records(4, 2), 1)  # (Python's json: the joined line is one bad line)
    docs, skipped, damaged = _read(path)
    assert [d.text for d in docs] == [r["text"] for r in _records(0, 6)] and skipped == {} and damaged == []
    assert [d.name for d in docs] == ["x.jsonl:1", "x.jsonl:2", "x.jsonl:3", "x.jsonl:3.2", "x.jsonl:4",
                                      "x.jsonl:5"]


@pytest.mark.parametrize("line, texts, bad", [
    ('{"text": "a"}\ufeff{"text": "b"}\ufeff{"text": "c"}', ["a", "b", "c"], 0),  # three files joined
    ('{"text": "a"}  \ufeff {"text": "b"}\r', ["a", "b"], 0),  # (white space around the mark)
    ('{"text": "cut sho\ufeff{"text": "b"}', ["b"], 1),  # a record cut short, then the next file: one bad line
    ('{"text": "a"}\ufeff{"text": "cut', ["a"], 1),
    ('{"text": "a"}\ufeff[1, 2]', ["a"], 1),  # (a part that is no object)
    ('{"text": "a"} x \ufeff{"text": "b"}', ["b"], 1),  # (no mark right after the first value)
    ('{"text": "a"}{"text": "b"}', [], 1),  # no mark: a bad line, as before
    ('  \ufeff{"text": "a"}', ["a"], 0),  # a mark after white space at a line's start
    ('{"text": "a\ufeffb"}\ufeff{"text": "c"}', ["a\ufeffb", "c"], 0),  # (a mark in a string is the string's)
])
def test_a_line_of_joined_records_gives_each_record_and_one_bad_line_at_most(tmp_path, line, texts, bad):
    path = tmp_path / "x.jsonl"
    path.write_bytes(line.encode() + b"\n")
    docs, skipped, _ = _read(path)
    assert [d.text for d in docs] == texts and skipped == ({"bad_json_line": 1} if bad else {}), skipped


def test_a_mark_inside_a_json_string_is_the_record_s_own(tmp_path):
    """U+FEFF in a string (ZERO WIDTH NO-BREAK SPACE, as text may hold it) is no file boundary: one record, as
    Python's json reads it."""
    line = '{"text": "a\ufeff{\\"text\\": 1}", "n": 1}\n'
    path = tmp_path / "x.jsonl"
    path.write_bytes(line.encode())
    assert _python_reads(line.encode(), "utf-8") == ([json.loads(line)], 0)
    docs, skipped, _ = _read(path)
    assert [d.text for d in docs] == [json.loads(line)["text"]] and skipped == {}
