"""A .jsonl unit's lines: where they end (LF, CRLF, or CR alone: classic Mac OS) and whether the unit is in UTF-16 or
UTF-32 (skipped whole by readers.py, which reads the lines; by its byte-order mark, or without one where its start
reads as JSON in it; a unit of white space alone in one is no skip, as a UTF-8 one of blank lines is none), and the
records of a line that files joined without a newline made one (`cat a.jsonl b.jsonl`, b saved with a UTF-8 mark)."""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterable, Iterator

LINE_END_LOOKAHEAD = 1 << 20  # bytes of a jsonl unit that tell its line ends (_line_end) and its encoding (wide_head)


def _line_end(chunks: Iterable[bytes]) -> tuple[bytes, Iterator[bytes]]:
    """(what a jsonl unit's lines end with, its chunks): b"\\r" where its first LINE_END_LOOKAHEAD bytes (all of it,
    if shorter) hold a CR and no LF (classic Mac OS line ends: split at LF the file was one bad line), else b"\\n"
    (LF, CRLF; a CR before an LF is JSON white space, or a CRLF's)."""
    chunks = iter(chunks)
    seen, size, cr = [], 0, False
    for chunk in chunks:
        seen.append(chunk)
        if b"\n" in chunk:
            return b"\n", itertools.chain(seen, chunks)
        size, cr = size + len(chunk), cr or b"\r" in chunk
        if size >= LINE_END_LOOKAHEAD:
            break
    return (b"\r" if cr else b"\n"), itertools.chain(seen, chunks)


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines split at b"\\n" (without it), numbered as bytes.split(b"\\n") numbers them; in a file of CR line ends
    (_line_end) at b"\\r", and at an LF too (a CRLF one end): an LF file whose first MiB, one line, held a CR."""
    end, chunks = _line_end(chunks)
    for line in _split(chunks, end):
        if end == b"\n" or b"\n" not in line:
            yield line
        else:
            yield from line.removeprefix(b"\n").split(b"\n")


def _split(chunks: Iterable[bytes], end: bytes) -> Iterator[bytes]:
    pending: list[bytes] = []  # the pieces of a line that spans chunks
    for chunk in chunks:
        parts = chunk.split(end)
        if len(parts) > 1:
            pending.append(parts[0])
            yield b"".join(pending)
            yield from parts[1:-1]
            pending.clear()
        pending.append(parts[-1])
    yield b"".join(pending)


# UTF-16 and UTF-32 in either byte order, as a head without a byte-order mark is tried (they exclude each other: a
# UTF-32 text read as UTF-16 holds U+0000, a UTF-16 one read as UTF-32 no valid code point, one order the other's
# ASCII as characters past U+00FF)
_WIDE = (("UTF-32", "utf-32-le"), ("UTF-32", "utf-32-be"), ("UTF-16", "utf-16-le"), ("UTF-16", "utf-16-be"))
GUESS_UNITS = 4  # ASCII characters (each with its zero bytes in place) that tell a guess, JSON's next one aside
_WS = " \t\r\n"  # JSON's white space
# what may follow a record line's first character, past white space: a key or the end of an object, a value or the
# end of an array
_NEXT = {"{": '"}', "[": '{["-0123456789tfn]'}
HEAD_BYTES = 64  # bytes past a unit's leading blank lines that wide_head reads the encoding from
_BLANK = b" \t\r\n\x00"  # a blank line's bytes in any of the encodings: white space and its zero bytes


def wide_encoding(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" where a jsonl unit's first bytes `head` are in one, else None (UTF-8: its lines are
    read, a bad one counted as such). A byte-order mark decides (UTF-8's too: None). Without one, a guess only where
    the head reads in that encoding (either byte order) as JSON text: white space, then `{` or `[`, no U+0000 (JSON
    allows none, nor a UTF-8 line any zero byte), and JSON's next character past white space (`"` or `}` after `{`,
    a value's first or `]` after `[`) or at least GUESS_UNITS ASCII characters, each with its zero bytes in place.
    Not the first bytes' zero pattern alone: b"X\\0\\0\\0" is 'X' in UTF-32LE or 'X' U+0000 in UTF-16LE, and
    b"\\0\\n\\0\\n{" a UTF-8 file led by NUL lines (its records were lost, skipped as UTF-16). Nor the ASCII count
    alone (375f4889): a record whose first key is long and in CJK has 2 in 64 bytes, `{}` 3, and such a file was
    read as one bad line a line, not named."""
    codec = wide_codec(head)
    return None if codec is None else family(codec)


def family(codec: str) -> str:
    """"UTF-16" or "UTF-32": the encoding a codec of _WIDE (or "utf-16", "utf-32": by the mark) is in."""
    return "UTF-32" if "32" in codec else "UTF-16"


def marked_codec(data: bytes) -> str | None:
    """The codec of the UTF-16 / UTF-32 byte-order mark that `data` starts with ("utf-16", "utf-32": Python's codec
    reads the mark and its byte order), else None."""
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):  # (UTF-16LE's mark starts UTF-32LE's)
        return "utf-32"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    return None


def wide_codec(head: bytes) -> str | None:
    """wide_encoding's finding as the codec that reads the unit: "utf-16" / "utf-32" by a mark, a codec of _WIDE by
    a guess, None for UTF-8."""
    if head.startswith(codecs.BOM_UTF8):  # (the rules below give None too: its bytes read as no `{` in any of them)
        return None
    if (marked := marked_codec(head)) is not None:
        return marked
    if b"\x00" not in head:  # (every ASCII character of UTF-16 / UTF-32 has a zero byte)
        return None
    return next((codec for _, codec in _WIDE if _json_start(head, codec)), None)


def _json_start(head: bytes, codec: str) -> bool:
    try:  # (not final: a character that the head cuts is left out, not an error)
        text = codecs.getincrementaldecoder(codec)("strict").decode(head)
    except UnicodeDecodeError:
        return False
    body = text.lstrip(_WS)
    if body[:1] not in _NEXT or "\x00" in text:
        return False
    # (a tuple of characters: "" is in any str, and the head may end before the next one)
    return body[1:].lstrip(_WS)[:1] in tuple(_NEXT[body[:1]]) or sum(c < "\x80" for c in text) >= GUESS_UNITS


def wide_head(lines: Iterator[bytes]) -> tuple[str | None, Iterator[bytes]]:
    """(wide_codec of a jsonl unit's first HEAD_BYTES bytes past its leading blank lines, within its first
    LINE_END_LOOKAHEAD bytes, the unit's lines from its first: those read, then `lines`). Not its first line alone: a
    UTF-16 file whose first line is blank starts that line with its newline's other byte (b"" or b"\\x00"), too
    short to tell (one bad line a line); nor its first non-blank line alone: `{` and white space may fill it. Where
    all it read is white space and zero bytes, the codec in which that is JSON white space (no U+0000): a UTF-16
    unit of blank lines (each of its lines read as UTF-8 held a zero byte and was counted as a bad line); where that
    runs past the first MiB, told by the bytes past it (_past_blank)."""
    read: list[bytes] = []
    size, lead, whole = 0, None, True  # (lead: the bytes before the first non-blank byte, once it is read)
    for line in lines:
        if lead is None and line.strip(_BLANK):
            lead = size + len(line) - len(line.lstrip(_BLANK))
        read.append(line)
        size += len(line) + 1
        if (lead is not None and size >= lead + HEAD_BYTES) or size >= LINE_END_LOOKAHEAD:
            whole = False
            break
    # (each b"\n" the split took out put back: the head's bytes as they are in the file, which a decoder reads; each
    # line cut first, so that a long one is not copied whole)
    cut = LINE_END_LOOKAHEAD if lead is None else lead + HEAD_BYTES
    head = b"\n".join(line[:cut] for line in read)[:cut]
    if lead is not None:
        return wide_codec(head), itertools.chain(read, lines)
    codec = _white_space_codec(head, whole)
    if codec is None or whole:
        return codec, itertools.chain(read, lines)
    return _past_blank(codec, read, lines)


def _past_blank(codec: str, read: list[bytes], lines: Iterator[bytes]) -> tuple[str | None, Iterator[bytes]]:
    """wide_head of a unit whose first MiB (`read`) is JSON white space in `codec`: wide_codec of HEAD_BYTES past
    its blank run, read from a start 4-aligned as the file is (a UTF-16 / UTF-32 character's start), and where the
    run holds no more than that, `codec` (holds_text: no skip). Not `codec` alone: b"\\0\\n" is a blank line in
    UTF-16BE and a NUL line in UTF-8, and a UTF-8 file led by a MiB of those lost its records, all of them, as one
    UTF-16 skip (it loses the NUL lines alone). The blank lines past the MiB are kept as runs of one line (padding
    repeats one), not one by one: a long run costs no memory."""
    runs: list[list] = []  # [line, times] of the blank lines read past `read`
    size, tail = sum(len(line) + 1 for line in read), (b"\n".join(line[-3:] for line in read[-3:]) + b"\n")[-3:]
    for line in lines:
        if not line.strip(_BLANK):
            if runs and runs[-1][0] == line:
                runs[-1][1] += 1
            else:
                runs.append([line, 1])
            size, tail = size + len(line) + 1, (tail + line[-3:] + b"\n")[-3:]
            continue
        lead = size + len(line) - len(line.lstrip(_BLANK))
        start, after = size - len(tail), [line]  # (the file offset of `tail`, the lines from the non-blank one)
        while size + sum(len(a) + 1 for a in after) < lead + HEAD_BYTES and (more := next(lines, None)) is not None:
            after.append(more)
        # (each line cut first, as in wide_head: a long line after a short one is not copied whole)
        head = (tail + b"\n".join(a[:lead + HEAD_BYTES - size] for a in after))[lead - lead % 4 - start:
                                                                                lead + HEAD_BYTES - start]
        blank = itertools.chain.from_iterable(itertools.repeat(line, times) for line, times in runs)
        return wide_codec(head), itertools.chain(read, blank, after, lines)
    return codec, itertools.chain(read, itertools.chain.from_iterable(itertools.repeat(*run) for run in runs))


def _white_space_codec(blank: bytes, whole: bool) -> str | None:
    """The codec of _WIDE in which `blank` (white space and zero bytes alone; `whole`: all of the unit, else its
    first MiB) is JSON white space, else None: a UTF-8 unit of blank lines (no zero byte), or of NUL lines (U+0000
    in each), whose lines are read as such."""
    if b"\x00" not in blank:  # (a UTF-16 / UTF-32 character of these bytes that is white space has a zero byte)
        return None
    for _, codec in _WIDE:
        try:  # (final where it is the whole unit: b" \\x00" is no UTF-32, whose 4 bytes a unit it does not fill)
            text = codecs.getincrementaldecoder(codec)("strict").decode(blank, final=whole)
        except UnicodeDecodeError:
            continue
        if "\x00" not in text and not text.strip(_WS):
            return codec
    return None


def holds_text(codec: str, lines: Iterable[bytes]) -> bool:
    """Whether a wide unit's lines (split at b"\\n") hold more than JSON white space in `codec`. A unit of white space
    alone gives no record in any encoding: no skip, as a UTF-8 one of blank lines is none. Reads up to the first
    character that is not white space (the head's, in a unit of records); bytes that are no text in `codec` count as
    text."""
    decoder = codecs.getincrementaldecoder(codec)("strict")
    try:
        for n, line in enumerate(lines):
            if decoder.decode(b"\n" + line if n else line).strip(_WS):
                return True
        return bool(decoder.decode(b"", final=True).strip(_WS))
    except UnicodeDecodeError:
        return True


_SCAN = json.JSONDecoder().scan_once  # (json's scanner: raw_decode's, without its error for a start that is no value)
TRIES = 32  # parts of a line that start as a JSON value and break off, read past at most (joined_records)


def joined_records(text: str) -> tuple[list, bool]:
    """(the JSON values of a line that holds several, each after a UTF-8 byte-order mark, in order; whether any of
    its parts is no JSON value). Only for a line that is no JSON as a whole: `cat a.jsonl b.jsonl` where a.jsonl
    ends without a newline and b.jsonl starts with a mark joins a's last record and b's first in one line, both lost
    as one bad line. A mark outside a JSON string is no JSON, so a part ends where its value does and the next
    mark follows; a mark in a string is read as the value's own. A part that is no value is passed over to the
    next mark (a record cut short, then the next file). json's error for a part costs the line's length up to it
    (its line and column), and one a mark made a line cut short in a string of many marks quadratic (2 MB, 160,000
    marks in prose: 167 s, 0.05 s before the split): a part whose first character starts no value builds none
    (scan_once's StopIteration), and past TRIES parts that start as a value and break off the rest is bad."""
    values, bad, pos, size, tries = [], False, 0, len(text), TRIES
    while True:
        pos = _skip_white_space(text, pos)
        if pos < size and text[pos] == "\ufeff":
            pos += 1
            continue
        if pos >= size:
            return values, bad
        try:
            value, end = _SCAN(text, pos)
        except StopIteration:
            end = pos + 1
        except ValueError:
            end, tries = pos + 1, tries - 1
        else:
            end = _skip_white_space(text, end)
            if end >= size or text[end] == "\ufeff":
                values.append(value)
                pos = end
                continue
        bad = True
        pos = text.find("\ufeff", end) if tries else -1
        if pos < 0:
            return values, bad


def _skip_white_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos
