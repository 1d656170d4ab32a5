"""Review of the .jsonl encoding leftovers (dab61d23, helper review120a), each case checked against what Python's codecs
and json read line by line:
(a) a UTF-16 / UTF-32 mark on a later line whose own line is blank (a wide file that starts with an empty line, joined
    after UTF-8 records) lost the wide part's records silently, the file not named: the lines wide_head had read
    past the mark's were not read again;
(b) a UTF-8 file led by more than a MiB of NUL lines (`\\0\\n`: blank lines in UTF-16BE) was skipped whole as UTF-16,
    all its records lost (before dab61d23 it lost the NUL lines alone, as docs/data.md says);
(c) a line cut short in a string of many U+FEFF marks built json's error, whose cost is the line's length, once a
    mark (2 MB, 160,000 marks: 167 s, 0.05 s before): counted here as errors built, not timed;
and randomized checks that UTF-8 files (a mark at the start, CRLF, CJK first keys, gzip, lines past a MiB) read as
Python reads them, and that files joined by `cat` read as Python reads them apart."""

import codecs
import gzip
import json
import json.decoder
import random
from collections import Counter

import pytest
from test_dataleft_jsonl import _python_reads

from longctx.data.builder import readers
from longctx.data.builder.line_ends import split_lines


def _read(path, name="x.jsonl"):
    skipped, damaged = Counter(), []
    docs = list(readers.iter_file(path, name, "text", skipped, damaged))
    return docs, dict(skipped), damaged


def _records(start, n):
    return [{"text": f"document {i} " + "word " * 5} for i in range(start, start + n)]


def _jsonl(records, end="\n"):
    return "".join(json.dumps(r, ensure_ascii=False) + end for r in records)


# -- (a) a later wide mark whose line is blank -----------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["utf-16", "utf-32", "utf-16-be-bom", "utf-32-be-bom"])
@pytest.mark.parametrize("blank", ["\n", "\r\n", " \n\n"])
@pytest.mark.parametrize("lead", ['{"text": "a"}\n', "\n\n", ""])
def test_a_later_wide_mark_on_a_blank_line_names_the_file(tmp_path, codec, blank, lead):
    wide = blank + _jsonl(_records(0, 1))  # (a short part: its record among the lines wide_head read)
    part = (codecs.BOM_UTF16_BE + wide.encode("utf-16-be") if codec == "utf-16-be-bom" else
            codecs.BOM_UTF32_BE + wide.encode("utf-32-be") if codec == "utf-32-be-bom" else wide.encode(codec))
    path = tmp_path / "x.jsonl"
    path.write_bytes(lead.encode() + part)
    assert [r for r in map(str.strip, part.decode(codec[:6]).split("\n")) if r] == [
        json.dumps(r, ensure_ascii=False) for r in _records(0, 1)]  # (the part read alone: its records)
    family = "utf32_file" if "32" in codec else "utf16_file"
    assert _read(path)[1:] == ({family: 1}, ["x.jsonl"]), (codec, blank, lead)


# -- (b) UTF-8 records after a MiB of NUL lines ----------------------------------------------------------------------

# (NUL lines of 1 KiB that are blank lines in UTF-16BE, in UTF-16LE, and one line of UTF-16LE spaces: short lines
# `\0\n` are the same case, 20 times slower to read)
@pytest.mark.parametrize("pad", [(b"\x00 " * 511 + b"\x00\n") * 1030, (b"\n\x00" + b" \x00" * 511) * 1030,
                                 b" \x00" * 530_000])
@pytest.mark.parametrize("compress", [False, True])
def test_utf8_records_after_a_mib_of_nul_lines_are_kept(tmp_path, pad, compress):
    data = pad + b"\n" + _jsonl(_records(0, 3)).encode()
    path = tmp_path / ("x.jsonl.gz" if compress else "x.jsonl")
    path.write_bytes(gzip.compress(data, compresslevel=1) if compress else data)
    records, bad = _python_reads(data, "utf-8")
    docs, skipped, damaged = _read(path, path.name)
    assert [d.text for d in docs] == [r["text"] for r in records] == [r["text"] for r in _records(0, 3)]
    assert skipped == {"bad_json_line": bad} and damaged == []
    first = data.count(b"\n") - 2  # (the records' lines are the last three)
    assert [d.name for d in docs] == [f"{path.name}:{first + k}" for k in range(3)]


@pytest.mark.parametrize("codec", ["utf-16-be", "utf-16-le", "utf-32-le"])
def test_wide_records_after_a_mib_of_wide_white_space_are_still_one_skip(tmp_path, codec):
    path = tmp_path / "x.jsonl"
    blank = "\n" * ((1 << 20) // (4 if "32" in codec else 2) + 1000) + " \r\n"  # (past the first MiB)
    path.write_bytes((blank + _jsonl(_records(0, 3))).encode(codec))
    assert _read(path) == ([], {"utf32_file" if "32" in codec else "utf16_file": 1}, ["x.jsonl"])
    path.write_bytes(blank.encode(codec))
    assert _read(path) == ([], {}, [])


# -- (c) json's errors on a line of many marks ------------------------------------------------------------------------

@pytest.mark.parametrize("unit, read_on", [("word \ufeffword ", True), ("\ufeffnull x", True), ("\ufeff{x ", False),
                                           ("\ufeff{\\\"a\\\": 1} ", False)])
def test_a_cut_line_of_many_marks_builds_few_json_errors(tmp_path, monkeypatch, unit, read_on):
    """Each json error costs the line's length up to it (its line and column): one a mark was quadratic. A mark in
    prose builds none, and the record joined after the cut one is read; parts that start as a value and break off
    stop the line's reading after line_ends.TRIES (the joined record lost: counted in the one bad line)."""
    built = [0]
    init = json.decoder.JSONDecodeError.__init__

    def counting(self, *args):
        built[0] += 1
        init(self, *args)
    monkeypatch.setattr(json.decoder.JSONDecodeError, "__init__", counting)
    line = '{"text": "' + unit * 5_000 + "\ufeff" + json.dumps(_records(1, 1)[0])
    path = tmp_path / "x.jsonl"
    path.write_bytes(line.encode() + b"\n" + _jsonl(_records(0, 1)).encode())
    docs, skipped, _ = _read(path)
    joined = [("x.jsonl:1", _records(1, 1)[0]["text"])] if read_on else []
    assert [(d.name, d.text) for d in docs] == joined + [("x.jsonl:2", _records(0, 1)[0]["text"])]
    assert skipped == {"bad_json_line": 1}
    assert built[0] <= 40, built[0]


def _kept(want):
    """(name, text) of the documents that records (name, text field) give: normalised, not empty."""
    return [(name, readers.normalise(text)) for name, text in want if readers.normalise(text).strip()]


# -- randomized: UTF-8 files and files joined by cat, against Python ------------------------------------------------

_WORDS = ["word", "文本", "données", "\ufeff", "a\ufeffb", "\\", '"', "{", "}", "\u00e9", "\U0001f600", " "]


def _record(rng):
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 12)))
    record = {"text": text} if rng.random() < 0.8 else {"文本标题" * rng.randint(1, 20): 1, "text": text}
    if rng.random() < 0.1:
        record["n"] = [1, {"k": "\ufeff"}]
    return record


def _file(rng) -> tuple[str, list]:
    """(a file's text, its records as Python reads its lines) of records, blank lines and CRLF ends."""
    records = [_record(rng) for _ in range(rng.randint(1, 6))]
    lines = [json.dumps(r, ensure_ascii=rng.random() < 0.3) + rng.choice(["\n", "\r\n", "\n\n", "\n \n"])
             for r in records]
    return "".join(lines), records


@pytest.mark.parametrize("seed", range(4))
def test_random_utf8_files_read_as_python_reads_them(tmp_path, seed):
    rng = random.Random(seed)
    for case in range(25):
        text, records = _file(rng)
        if case % 5 == 0:  # (a line past a MiB: head and lookahead cut it)
            text = json.dumps({"text": "x" * (1 << 20) + "文本"}) + "\n" + text
        if case % 7 == 0:  # (a first MiB of blank lines)
            text = "\n" * (1 << 20) + text
        data = (codecs.BOM_UTF8 if rng.random() < 0.3 else b"") + text.encode()
        gz = rng.random() < 0.3
        path = tmp_path / f"c{case}.jsonl{'.gz' if gz else ''}"
        path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
        lines = data.decode("utf-8-sig").split("\n")
        want = [(f"{path.name}:{i}", json.loads(s)["text"]) for i, s in enumerate(lines, start=1) if s.strip()]
        docs, skipped, damaged = _read(path, path.name)
        assert [(d.name, d.text) for d in docs] == _kept(want)
        assert damaged == [] and set(skipped) <= {"empty"}, skipped


@pytest.mark.parametrize("seed", range(6))
def test_random_files_joined_by_cat_read_as_python_reads_them_apart(tmp_path, seed):
    """cat of files, some saved with a UTF-8 mark, some without a final newline, some whose last record was cut
    short: each intact record is kept, in order, a joined line's parts named LINE, LINE.2, ...; each line with a
    cut record is one bad line."""
    rng = random.Random(100 + seed)
    for case in range(20):
        data, want, bad, line, part = b"", [], 0, 1, 1
        for f in range(rng.randint(2, 5)):
            text, records = _file(rng)
            mark = f > 0 and (rng.random() < 0.7 or not data.endswith(b"\n"))  # (no mark, no newline: one bad line)
            cut = rng.random() < 0.25
            if cut:  # (the last record cut short, its `}` at least)
                text = text.rstrip()
                text = text[:rng.randint(text.rfind("\n") + 2, len(text) - 1)]
                records = records[:-1]
            elif rng.random() < 0.5:
                text = text.rstrip("\n ")
            data += (codecs.BOM_UTF8 if mark else b"") + text.encode()
            for n, chunk in enumerate(text.split("\n")):
                if n:
                    line, part = line + 1, 1
                if chunk.strip() and (n < len(text.split("\n")) - 1 or not cut):
                    want.append((f"x.jsonl:{line}" + (f".{part}" if part > 1 else ""), records.pop(0)["text"]))
                    part += 1
            bad += cut
        path = tmp_path / "x.jsonl"
        path.write_bytes(data)
        docs, skipped, damaged = _read(path)
        assert [(d.name, d.text) for d in docs] == _kept(want)
        assert skipped.get("bad_json_line", 0) == bad and damaged == [], (case, skipped)


def test_split_lines_of_a_joined_unit_keep_their_numbers():
    """A mark's line numbers are the file's (bytes.split), LINE.2 the second record of line LINE."""
    data = b'{"text": "a"}' + codecs.BOM_UTF8 + b'{"text": "b"}\n\n{"text": "c"}'
    assert [(i, r["text"]) for i, r in readers.jsonl_records(split_lines([data]), Counter())] == [
        (1, "a"), ("1.2", "b"), (3, "c")]
