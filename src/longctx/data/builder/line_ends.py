"""A .jsonl unit's lines: where they end (LF, CRLF, or CR alone: classic Mac OS) and whether the unit is in UTF-16 or
UTF-32 (skipped whole by readers.py, which reads the lines)."""

from __future__ import annotations

import itertools
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


def wide_encoding(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" where a jsonl unit's first bytes `head` are in one (its byte-order mark, or without one
    the zero bytes of an ASCII character, `{` or white space, in either byte order), else None. A UTF-8 line
    starts with no zero byte: JSON allows none outside a string."""
    if head.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    zero = tuple(b == 0 for b in head[:4])
    if zero in ((False, True, True, True), (True, True, True, False)):
        return "UTF-32"
    return "UTF-16" if zero in ((False, True, False, True), (True, False, True, False)) else None


def wide_head(lines: Iterator[bytes]) -> tuple[str | None, list[bytes]]:
    """(wide_encoding of a jsonl unit's start through its first non-blank line, within its first
    LINE_END_LOOKAHEAD bytes, the lines read). Not its first line alone: a UTF-16 file whose first line is blank
    starts that line with its newline's other byte (b"" or b"\\x00"), too short to tell (one bad line a line)."""
    read: list[bytes] = []
    size = 0
    for line in lines:  # (white space and its zero bytes: a blank line in any of the encodings)
        read.append(line)
        size += len(line) + 1
        if line.strip(b" \t\r\n\x00") or size >= LINE_END_LOOKAHEAD:
            break
    # (each b"\n" the split took out put back: only which bytes are zero tells, and no line end is a zero byte)
    return wide_encoding(b"\n".join([*read[:-1], read[-1][:8]]) if read else b""), read
