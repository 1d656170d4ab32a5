"""Reading and normalising input documents: directories of text files, `.jsonl`, `.parquet`, Arrow
(Hugging Face `datasets` saved with `save_to_disk`, or a lone `.arrow` file), `stdlib`; text and
`.jsonl` files also compressed (`.gz`, `.zst`).

Every input yields `Document(name, text)` (with `--response-field`, a record's prompt and response:
`Document.trained_chars`); the name is stable (a path relative to the input
directory, or `file.jsonl:LINE`, `file.parquet:ROW`, `dataset/data-00000-of-00001.arrow:ROW`),
because the train/eval split hashes it. A compressed file's name keeps its compression suffix
(`a/b.jsonl.gz:12`), so a compressed and an uncompressed copy are different documents. Text is
normalised: UTF-8 BOM dropped, CRLF/CR line ends turned into LF, Unicode NFC.

Inputs are read one *unit* at a time (`iter_file`): a file, or one arrow file of a saved dataset,
yielding its documents in order without holding the unit in memory (jsonl line by line, also
through the decompressor; parquet and arrow record batch by record batch, table_readers.py; a plain
text file is one document and is read whole). Which units an input has, and in what order, is inputs.py's job.

Formats, by suffix: the suffix before `.gz` / `.zst` decides (`x.jsonl.zst` is jsonl, `notes.txt.gz`
and `mod.py.zst` are text); parquet and arrow are compressed inside already, so `x.parquet.gz` is not
read (skipped as `other_suffix`). An `.arrow` file (one of a saved dataset's, or a lone one) is read
as an Arrow IPC stream (what `datasets` writes) or an Arrow IPC file.

Bad input never stops a build half-way: an empty or whitespace-only document, a binary file (a NUL
byte in its first 8 KiB), invalid UTF-8, an unparsable JSON line, a record without the text field,
a corrupt parquet or arrow file, a corrupt compressed file (bad gzip / zstd data, a truncated
stream, an empty file) or one that cannot be opened or read (permissions, an I/O error part-way) is
skipped and counted under its reason, and its name is recorded (`damaged`). A .jsonl file in UTF-16 or UTF-32 is
skipped whole, one skip, named as well (told from its start, blank lines and the 64 bytes after them: a byte-order
mark, or without one a start that reads as JSON in it, line_ends.wide_encoding; also a UTF-16 / UTF-32 mark at a
later line's start, such a file joined after UTF-8 lines), unless it holds white space alone (no skip, as for UTF-8
blank lines); one with CR line ends (no LF in its first MiB) is split at CR (and LF). A UTF-8 BOM at a line's start
is dropped (files joined: `cat a b`), and within a line it parts the records that joined files put in one.
A file found damaged part-way has already yielded the documents before the damage (a stream cannot
take them back), but they are not to be trusted: gzip and zstd find damage only at the end of a
block or frame (its checksum), after the text before it came out wrong. So the readers' callers
(`read_inputs`, the scan) drop every document of a file named in `damaged`: a damaged file gives no document.
What cannot be read at all (a missing path, an input directory with no usable file, a saved dataset missing a
data file it lists, a parquet or arrow file without the text column, pyarrow or zstandard missing) is a
`DataError`: before any output is written, except the missing column, which shows when the unit is
first read.
"""

from __future__ import annotations

import gzip
import itertools
import json
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import accumulate
from pathlib import Path

from .corpus import Document
from .line_ends import family, holds_text, joined_records, marked_codec, split_lines, wide_head
from .table_readers import data_extra, import_pyarrow, iter_arrow, iter_parquet

COMPRESSION_SUFFIXES = {".gz", ".zst"}
CHUNK = 1 << 20  # bytes read (or decompressed) at a time when streaming a file
_NO_RESPONSE = object()  # a plain document's record (no --response-field)


# Every reason a file or document is skipped for (the keys of `inputs.ReadResult.skipped`, of a scan's
# counts and of the manifest's "skipped"), and how messages name it.
SKIP_REASONS = {
    "empty": "empty",                            # no text, or whitespace only
    "binary": "binary",                          # a NUL byte in the first 8 KiB
    "invalid_utf8": "not UTF-8",                 # also a JSON string "\ud800" (a lone surrogate)
    # a .jsonl file in UTF-16 / UTF-32 (a byte-order mark, or a JSON start in it): skipped whole, counted once
    # (a mark after UTF-8 lines: files joined; iconv of the whole file garbles it)
    "utf16_file": "UTF-16 .jsonl file (convert it to UTF-8: iconv -f UTF-16 -t UTF-8 IN > OUT; without a "
                  "byte-order mark -f UTF-16LE, or -f UTF-16BE where its first byte is 0; one whose mark follows "
                  "UTF-8 lines, files joined: convert the part from the mark on)",
    "utf32_file": "UTF-32 .jsonl file (convert it to UTF-8: iconv -f UTF-32 -t UTF-8 IN > OUT; without a "
                  "byte-order mark -f UTF-32LE, or -f UTF-32BE where its first byte is 0; one whose mark follows "
                  "UTF-8 lines, files joined: convert the part from the mark on)",
    "other_suffix": "unsupported suffix",        # a file of a kind no reader takes (e.g. .png, .parquet.gz)
    "bad_json_line": "unparsable JSON line",     # also a line that is not a JSON object
    "missing_text_field": "no text field",       # a record without the text field, or a non-string value
    "missing_response_field": "no response field",  # with --response-field: a record without it, or not a string
    "pair_longer_than_sample": "pair longer than a sample",  # an instruction pair that would be cut (assembly.py)
    "bad_conversation": "not a conversation",    # --messages-field: not role/content messages ending with an answer
    "chat_template_not_prefix": "template not prefix-stable",  # (conversations.py)
    "unreadable": "unreadable",                  # the file could not be opened or read
    "bad_compressed_file": "corrupt .gz/.zst",
    "bad_parquet_file": "corrupt parquet",
    "bad_arrow_file": "corrupt arrow",
}
# the reasons that say an input file is damaged (named in messages and the manifest, none of its documents kept);
# "unreadable" too: an I/O error part-way left it read in part, and a count alone did not name it
# and a .jsonl file in UTF-16 / UTF-32, named so that the one to convert is known
DAMAGE_REASONS = ("bad_compressed_file", "bad_parquet_file", "bad_arrow_file", "unreadable", "utf16_file",
                  "utf32_file")


def skipped_text(skipped: dict) -> str:
    """'32 skipped: 20 empty, 12 binary' (most frequent reason first), or 'nothing skipped'."""
    counts = sorted(((n, k) for k, n in skipped.items() if n), key=lambda nk: (-nk[0], nk[1]))
    if not counts:
        return "nothing skipped"
    reasons = ", ".join(f"{n:,} {SKIP_REASONS.get(k, k.replace('_', ' '))}" for n, k in counts)
    return f"{sum(n for n, _ in counts):,} skipped: {reasons}"



def normalise(text: str) -> str:
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return text


def decode(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, skip reason)."""
    if b"\x00" in raw[:8192]:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    text = normalise(text)
    if not text.strip():
        return None, "empty"
    return text, None


def unit_format(path: Path) -> tuple[str | None, str | None]:
    """(format, compression) of a unit by its suffixes: format is 'jsonl', 'parquet', 'arrow' or
    'text' (any other suffix: a file named on its own is read as text), None for a compressed
    parquet / arrow file; compression is '.gz', '.zst' or None."""
    name = path.name.lower()
    compression = next((c for c in COMPRESSION_SUFFIXES if name.endswith(c)), None)
    inner = Path(name[: -len(compression)]).suffix if compression else Path(name).suffix
    if inner in (".parquet", ".arrow"):
        return (None if compression else inner[1:]), compression
    return ("jsonl" if inner == ".jsonl" else "text"), compression


# -- the optional libraries, imported when a unit needs them -------------------------------------

def check_libraries(files: list[Path]) -> None:
    """A missing optional library is an error now, before anything is read or written."""
    for f in files:
        if unit_format(f)[0] in ("parquet", "arrow"):
            import_pyarrow(f)
            break
    for f in files:
        if unit_format(f)[1] == ".zst":
            data_extra("zstandard", f)
            break


# -- byte streams ----------------------------------------------------------------------------------

class ReadPosition:
    """How far the reading of a unit is, in bytes of its file on disk (compressed ones too), for progress: a
    long file is counted as it is read, not only once it is done (`iter_file` points it at what it reads)."""

    def __init__(self):
        self.tell = lambda: 0

    def at_file(self, f) -> None:
        def tell() -> int:
            try:
                return f.tell()
            except (OSError, ValueError):  # (closed: the unit is done, and counted whole by the caller)
                return 0
        self.tell = tell

    def at_rows(self, rows_of: int, size: int):
        """A count of `rows_of` rows in a file of `size` bytes (parquet: its rows fill it evenly enough); the
        callable that moves it (rows done so far)."""
        done = [0]
        self.tell = lambda: size * done[0] // max(rows_of, 1)

        def moved(rows: int) -> None:
            done[0] = rows
        return moved


class _BadCompressed(Exception):
    """The compressed data of a unit is corrupt or truncated."""


def _raw_chunks(f) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def _gzip_chunks(f) -> Iterator[bytes]:
    gz = gzip.GzipFile(fileobj=f, mode="rb")
    try:
        yield from _raw_chunks(gz)
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; EOFError: truncated
        raise _BadCompressed(str(e)) from None


def _zstd_chunks(f, path: Path) -> Iterator[bytes]:
    # One decompressobj per frame, not read_across_frames: only a frame that ends says the data is
    # complete, so a truncated file is caught instead of silently yielding less.
    zstd = data_extra("zstandard", path)
    dctx = zstd.ZstdDecompressor()
    frame, started = dctx.decompressobj(), False
    try:
        for data in _raw_chunks(f):
            while data:
                out = frame.decompress(data)
                started = True
                if out:
                    yield out
                if frame.eof:
                    data = frame.unused_data
                    frame, started = dctx.decompressobj(), False
                else:
                    data = b""
    except zstd.ZstdError as e:
        raise _BadCompressed(str(e)) from None
    if started:
        raise _BadCompressed("truncated zstd stream: the last frame does not end")


def _chunks(f, compression: str | None, path: Path) -> Iterator[bytes]:
    if compression == ".gz":
        return _gzip_chunks(f)
    if compression == ".zst":
        return _zstd_chunks(f, path)
    return _raw_chunks(f)


# -- one unit --------------------------------------------------------------------------------------

def _text(value, skipped: Counter, missing: str) -> str | None:
    """A field's value as normalised text, or None (counted under its reason)."""
    if not isinstance(value, str):
        skipped[missing] += 1
        return None
    if "\x00" in value[:8192]:
        skipped["binary"] += 1
        return None
    if not value.isascii():
        try:  # a JSON string may hold a lone surrogate ("\ud800"), which is no UTF-8 text
            value.encode("utf-8")
        except UnicodeEncodeError:
            skipped["invalid_utf8"] += 1
            return None
    return normalise(value)


def _accept(value, name: str, skipped: Counter, response=_NO_RESPONSE) -> Document | None:
    """A record's document: its text field's value, or with a response (`--response-field`) the prompt
    (the text field, which may be empty) followed by the response (which may not: nothing to train on but
    the EOS)."""
    text = _text(value, skipped, "missing_text_field")
    if text is None or response is _NO_RESPONSE:
        return text if text is None else _document(name, [text], skipped)
    answer = _text(response, skipped, "missing_response_field")
    return None if answer is None else _document(name, [text, answer], skipped)


def _document(name: str, pieces: list[str], skipped: Counter, templated: bool = False) -> Document | None:
    """The document of normalised `pieces`: one, a plain document; else prompt, answer, turns between,
    answer, ..., answer (instruction data, trained on the answers). None (counted) when nothing after the
    prompt holds more than white space."""
    text = "".join(pieces)
    ends = list(accumulate(len(piece) for piece in pieces[:-1]))
    if not text[ends[0] if ends else 0:].strip():
        skipped["empty"] += 1
        return None
    return Document(name, text, trained_chars=tuple(ends) if ends else None, templated=templated)


def _record_reader(text_field: str, response_field: str, conversations):
    """(the record's fields as (name, the option naming it, what it holds), accept(values, name, skipped):
    the record's document or None) of a plain document, an instruction pair or a conversation."""
    if conversations is not None:
        def accept(values, name, skipped):
            pieces = conversations.pieces(values[0], skipped)
            if pieces is None or _text("".join(pieces), skipped, "bad_conversation") is None:  # (binary, bad UTF-8)
                return None
            return _document(name, [normalise(piece) for piece in pieces], skipped, templated=True)
        return [(conversations.field, "--messages-field", "conversation")], accept
    if response_field:
        return ([(text_field, "--text-field", "prompt"), (response_field, "--response-field", "response")],
                lambda values, name, skipped: _accept(values[0], name, skipped, values[1]))
    return [(text_field, "--text-field", "document text")], lambda values, name, skipped: _accept(values[0], name,
                                                                                                  skipped)


def field_value(record: dict, field: str):
    """A jsonl record's `field`: the key of that name, else (a dotted name, `meta.text`) the path through nested
    objects, as Hugging Face nested JSON holds it; None where neither is there. The literal key wins: a record
    with a key "meta.text" gives that, whatever its "meta" object holds."""
    if field in record or "." not in field:
        return record.get(field)
    value = record
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def jsonl_lines(f, compression: str | None, path: Path) -> Iterator[bytes]:
    """The lines of an open jsonl unit `f` (compressed by `compression`), as `_iter_jsonl` reads them."""
    return split_lines(_chunks(f, compression, path))


def jsonl_records(lines: Iterable[bytes], skipped: Counter) -> Iterator[tuple[int | str, dict]]:
    """(line number from 1, record) of a jsonl unit's lines, each JSON object a line holds; what is no record is
    counted into `skipped`, and a unit in UTF-16 or UTF-32 (wide_head), or with a part in one after its UTF-8 lines,
    is one skip and gives none past that part's start (none at all: it is named with the damaged files). A unit of
    white space alone in UTF-16 / UTF-32 is no skip, as a UTF-8 one of blank lines is none. The records of a line
    that files joined without a newline made one (line_ends.joined_records) are numbered LINE, LINE.2, ... The
    build's reading and the missing-field hint's (field_hint.py) are this one."""
    codec, lines = wide_head(iter(lines))  # (an iterator of all the unit's lines, from its first)
    if codec:
        # (read as UTF-8 each of its lines was one more bad line, thousands of them: the file, skipped whole,
        # is one skip, named with the damaged files, that says how to convert it)
        if holds_text(codec, lines):
            skipped[_WIDE_SKIPS[family(codec)]] += 1
        return
    for i, line in enumerate(lines, start=1):
        # A UTF-8 BOM at a line's start (a file's start, or where files were concatenated, the second saved with
        # one) is dropped before the line is read, a blank one too; within a line, joined_records reads it.
        line = line.removeprefix(b"\xef\xbb\xbf")
        if not line.strip():
            continue
        # Decoded as UTF-8 here, not by json.loads, which takes bytes in UTF-16 and UTF-32 too: a UTF-16 file
        # gave its first line as a document (split at b"\n", the lines after it are misaligned) and the rest
        # as bad JSON.
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            codec = marked_codec(line)
            if codec is None:
                skipped["invalid_utf8"] += 1
                continue
            # A UTF-16 / UTF-32 mark at a line's start: a file in that encoding joined after this one's UTF-8 lines
            # (blank ones, or records): one skip, as a file in it is (its lines were one bad line each); read on
            # from the next line, be it one wide_head read (the mark's line blank: its records went unnamed)
            if holds_text(codec, itertools.chain([line], lines)):
                skipped[_WIDE_SKIPS[family(codec)]] += 1
            return
        yield from _line_records(i, text, skipped)


_WIDE_SKIPS = {"UTF-16": "utf16_file", "UTF-32": "utf32_file"}


def _line_records(i: int, text: str, skipped: Counter) -> Iterator[tuple[int | str, dict]]:
    """(i, the record) of line `i`, or of a line that joined files made one, (i, LINE.2, ...); a bad line counted
    once, however many of its parts are no record."""
    try:
        record = json.loads(text)
    except ValueError:
        if "\ufeff" not in text:  # (the usual bad line: no file joined in it)
            skipped["bad_json_line"] += 1
            return
        values, bad = joined_records(text)
        records = [v for v in values if isinstance(v, dict)]
        if bad or not records or len(records) < len(values):
            skipped["bad_json_line"] += 1
        for k, record in enumerate(records, start=1):
            yield (i if k == 1 else f"{i}.{k}"), record
        return
    if isinstance(record, dict):
        yield i, record
    else:
        skipped["bad_json_line"] += 1


def _iter_jsonl(lines: Iterable[bytes], name: str, fields: list[tuple], accept, skipped: Counter) -> Iterator[Document]:
    for i, record in jsonl_records(lines, skipped):
        doc = accept([field_value(record, f) for f, _, _ in fields], f"{name}:{i}", skipped)
        if doc is not None:
            yield doc


def _iter_bytes_file(path: Path, name: str, fmt: str, compression: str | None, fields: list[tuple], accept,
                     skipped: Counter, position: ReadPosition) -> Iterator[Document]:
    try:
        f = open(path, "rb")
    except OSError:
        skipped["unreadable"] += 1
        return
    position.at_file(f)  # (the file on disk: a compressed one's bytes read, not those decompressed)
    with f:
        try:
            if compression and not f.peek(1):  # no gzip or zstd stream at all: a download cut before it began
                skipped["bad_compressed_file"] += 1
                return
        except OSError:
            skipped["unreadable"] += 1
            return
        chunks = _chunks(f, compression, path)
        try:
            if fmt == "jsonl":
                yield from _iter_jsonl(split_lines(chunks), name, fields, accept, skipped)
                return
            text, why = decode(b"".join(chunks))
        except _BadCompressed:
            skipped["bad_compressed_file"] += 1
            return
        except OSError:
            skipped["unreadable"] += 1
            return
    if why:
        skipped[why] += 1
    else:
        yield Document(name, text)


def iter_file(path: Path, name: str, text_field: str, skipped: Counter,
              damaged: list[str] | None = None, response_field: str = "", conversations=None,
              position: ReadPosition | None = None) -> Iterator[Document]:
    """The documents of one unit, in order, one at a time: a text file is one document named
    `name`; a jsonl file one per line (`name:LINE`), a parquet or arrow file one per row
    (`name:ROW`, from 1). Skips are counted into `skipped[reason]`. A corrupt compressed, parquet or
    arrow file counts one skip ('bad_compressed_file', 'bad_parquet_file', 'bad_arrow_file') and
    ends there, `name` appended to `damaged` (if given): the caller drops the documents it yielded before
    (the module's docstring says why). Raises DataError for a parquet or
    arrow file without the `text_field` column and for a missing pyarrow / zstandard. With
    `response_field`, a record (jsonl line, parquet or arrow row) is an instruction pair: its text field
    the prompt, this field the response (Document.trained_chars); with `conversations`
    (conversations.Conversations), its field holds a conversation made a pair by the chat template. A
    text file stays a plain document either way. `position` (a ReadPosition): how far the reading is, kept."""
    fmt, compression = unit_format(path)
    position = position or ReadPosition()
    fields, accept = _record_reader(text_field, response_field, conversations)
    before = sum(skipped[r] for r in DAMAGE_REASONS)
    if fmt is None:
        skipped["other_suffix"] += 1
    elif fmt == "parquet":
        yield from iter_parquet(path, name, fields, accept, skipped, position)
    elif fmt == "arrow":
        yield from iter_arrow(path, name, fields, accept, skipped, position)
    else:
        yield from _iter_bytes_file(path, name, fmt, compression, fields, accept, skipped, position)
    if damaged is not None and sum(skipped[r] for r in DAMAGE_REASONS) > before:
        damaged.append(name)  # (not reached when the caller stops early, --max-docs: nothing was found)
