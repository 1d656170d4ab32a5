"""Reading and normalising input documents: directories of text files, `.jsonl`, `.parquet`, Arrow
(Hugging Face `datasets` saved with `save_to_disk`, or a lone `.arrow` file), `stdlib`; text and
`.jsonl` files also compressed (`.gz`, `.zst`).

Every input yields `Document(name, text)`; the name is stable (a path relative to the input
directory, or `file.jsonl:LINE`, `file.parquet:ROW`, `dataset/data-00000-of-00001.arrow:ROW`),
because the train/eval split hashes it. A compressed file's name keeps its compression suffix
(`a/b.jsonl.gz:12`), so a compressed and an uncompressed copy are different documents. Text is
normalised: UTF-8 BOM dropped, CRLF/CR line ends turned into LF, Unicode NFC.

Inputs are read one *unit* at a time (`iter_file`): a file, or one arrow file of a saved dataset,
yielding its documents in order without holding the unit in memory (jsonl line by line, also
through the decompressor; parquet and arrow record batch by record batch; a plain text file is one
document and is read whole). Which units an input has, and in what order, is inputs.py's job.

Formats, by suffix: the suffix before `.gz` / `.zst` decides (`x.jsonl.zst` is jsonl, `notes.txt.gz`
and `mod.py.zst` are text); parquet and arrow are compressed inside already, so `x.parquet.gz` is not
read (skipped as `other_suffix`). An `.arrow` file (one of a saved dataset's, or a lone one) is read
as an Arrow IPC stream (what `datasets` writes) or an Arrow IPC file.

Bad input never stops a build half-way: an empty or whitespace-only document, a binary file (a NUL
byte in its first 8 KiB), invalid UTF-8, an unparsable JSON line, a record without the text field,
a corrupt parquet or arrow file, or a corrupt compressed file (bad gzip / zstd data, a truncated
stream, an empty file) is skipped and counted under its reason, and its name is recorded (`damaged`).
A file found damaged part-way has already yielded the documents before the damage (a stream cannot
take them back), but they are not to be trusted: gzip and zstd find damage only at the end of a
block or frame (its checksum), after the text before it came out wrong. So the readers' callers
(`read_inputs`, the scan) drop every document of a file named in `damaged`: a damaged file gives
no document. What cannot be read at all
(a missing path, an input directory with no usable file, a saved dataset missing a data file it
lists, a parquet or arrow file without the text column, pyarrow or zstandard missing) is a
`DataError`: before any output is written, except the missing column, which shows when the unit is
first read.
"""

from __future__ import annotations

import gzip
import json
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from ...errors import DataError
from .corpus import Document

COMPRESSION_SUFFIXES = {".gz", ".zst"}
CHUNK = 1 << 20  # bytes read (or decompressed) at a time when streaming a file
ROWS = 4096  # parquet / arrow values converted to Python at a time


# Every reason a file or document is skipped for (the keys of `inputs.ReadResult.skipped`, of a scan's
# counts and of the manifest's "skipped"), and how messages name it.
SKIP_REASONS = {
    "empty": "empty",                            # no text, or whitespace only
    "binary": "binary",                          # a NUL byte in the first 8 KiB
    "invalid_utf8": "not UTF-8",                 # also a JSON string with a lone surrogate ("\ud800")
    "other_suffix": "unsupported suffix",        # a file of a kind no reader takes (e.g. .png, .parquet.gz)
    "bad_json_line": "unparsable JSON line",     # also a line that is not a JSON object
    "missing_text_field": "no text field",       # a record without the text field, or a non-string value
    "unreadable": "unreadable",                  # the file could not be opened or read
    "bad_compressed_file": "corrupt .gz/.zst",
    "bad_parquet_file": "corrupt parquet",
    "bad_arrow_file": "corrupt arrow",
}
# the reasons that say an input file is damaged (messages and the manifest name such files)
DAMAGE_REASONS = ("bad_compressed_file", "bad_parquet_file", "bad_arrow_file")


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

def _pyarrow(path: Path):
    try:  # an optional package (the `data` extra)
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            f"reading '{path}' needs pyarrow, which is not installed; install the data extra with "
            f"pip install 'longctx[data]' (or pip install pyarrow)."
        ) from None
    return pyarrow


def _zstandard(path: Path):
    try:  # an optional package (the `data` extra)
        import zstandard
    except ImportError:
        raise DataError(
            f"reading '{path}' needs zstandard, which is not installed; install the data extra with "
            f"pip install 'longctx[data]' (or pip install zstandard)."
        ) from None
    return zstandard


def check_libraries(files: list[Path]) -> None:
    """A missing optional library is an error now, before anything is read or written."""
    for f in files:
        if unit_format(f)[0] in ("parquet", "arrow"):
            _pyarrow(f)
            break
    for f in files:
        if unit_format(f)[1] == ".zst":
            _zstandard(f)
            break


# -- byte streams ----------------------------------------------------------------------------------

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
    zstd = _zstandard(path)
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


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines split at b"\\n" (without it), numbered as bytes.split(b"\\n") numbers them."""
    pending: list[bytes] = []  # the pieces of a line that spans chunks
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) > 1:
            pending.append(parts[0])
            yield b"".join(pending)
            yield from parts[1:-1]
            pending.clear()
        pending.append(parts[-1])
    yield b"".join(pending)


# -- one unit --------------------------------------------------------------------------------------

def _accept(value, name: str, skipped: Counter) -> Document | None:
    if not isinstance(value, str):
        skipped["missing_text_field"] += 1
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
    value = normalise(value)
    if not value.strip():
        skipped["empty"] += 1
        return None
    return Document(name, value)


def _iter_jsonl(lines: Iterable[bytes], name: str, text_field: str, skipped: Counter) -> Iterator[Document]:
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            skipped["bad_json_line"] += 1
            continue
        if not isinstance(record, dict):
            skipped["bad_json_line"] += 1
            continue
        doc = _accept(record.get(text_field), f"{name}:{i}", skipped)
        if doc is not None:
            yield doc


def _iter_bytes_file(path: Path, name: str, fmt: str, compression: str | None, text_field: str,
                     skipped: Counter) -> Iterator[Document]:
    try:
        f = open(path, "rb")
    except OSError:
        skipped["unreadable"] += 1
        return
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
                yield from _iter_jsonl(_lines(chunks), name, text_field, skipped)
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


def _missing_column(kind: str, path: Path, text_field: str, columns: list[str]) -> DataError:
    return DataError(
        f"{kind} file '{path}' has no column '{text_field}' (columns: {', '.join(columns)}); "
        f"pass --text-field with the column that holds the document text."
    )


def _iter_values(batches: Iterator, column, name: str, skipped: Counter, reason: str) -> Iterator[Document]:
    """Documents of the `column` (index or callable) of record batches; a batch that cannot be read
    ends the unit, counted under `reason`."""
    row = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception:  # pyarrow raises several types for corrupt data
            skipped[reason] += 1
            return
        values = batch.column(column)
        for start in range(0, len(values), ROWS):
            for value in values.slice(start, ROWS).to_pylist():
                row += 1
                doc = _accept(value, f"{name}:{row}", skipped)
                if doc is not None:
                    yield doc


def _iter_parquet(path: Path, name: str, text_field: str, skipped: Counter) -> Iterator[Document]:
    pq = _pyarrow(path).parquet
    try:
        pf = pq.ParquetFile(str(path))
    except Exception:  # pyarrow raises several types for a corrupt file
        skipped["bad_parquet_file"] += 1
        return
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise _missing_column("parquet", path, text_field, columns)
    yield from _iter_values(pf.iter_batches(columns=[text_field], batch_size=ROWS), 0, name, skipped,
                            "bad_parquet_file")


def _iter_arrow(path: Path, name: str, text_field: str, skipped: Counter) -> Iterator[Document]:
    pa = _pyarrow(path)
    try:
        source = pa.memory_map(str(path))  # batches are read in place, not copied into memory
    except OSError:
        skipped["unreadable"] += 1
        return
    with source:
        try:
            stream = pa.ipc.open_stream(source)  # what datasets' save_to_disk writes
            schema, batches = stream.schema, iter(stream)
        except Exception:
            try:
                source.seek(0)
                file = pa.ipc.open_file(source)
                schema = file.schema
                batches = (file.get_batch(i) for i in range(file.num_record_batches))
            except Exception:
                skipped["bad_arrow_file"] += 1
                return
        if text_field not in schema.names:
            raise _missing_column("arrow", path, text_field, schema.names)
        yield from _iter_values(batches, schema.get_field_index(text_field), name, skipped, "bad_arrow_file")


def iter_file(path: Path, name: str, text_field: str, skipped: Counter,
              damaged: list[str] | None = None) -> Iterator[Document]:
    """The documents of one unit, in order, one at a time: a text file is one document named
    `name`; a jsonl file one per line (`name:LINE`), a parquet or arrow file one per row
    (`name:ROW`, from 1). Skips are counted into `skipped[reason]`. A corrupt compressed, parquet or
    arrow file counts one skip ('bad_compressed_file', 'bad_parquet_file', 'bad_arrow_file') and
    ends there, `name` appended to `damaged` (if given): the caller drops the documents it yielded before
    (the module's docstring says why). Raises DataError for a parquet or
    arrow file without the `text_field` column and for a missing pyarrow / zstandard."""
    fmt, compression = unit_format(path)
    before = sum(skipped[r] for r in DAMAGE_REASONS)
    if fmt is None:
        skipped["other_suffix"] += 1
    elif fmt == "parquet":
        yield from _iter_parquet(path, name, text_field, skipped)
    elif fmt == "arrow":
        yield from _iter_arrow(path, name, text_field, skipped)
    else:
        yield from _iter_bytes_file(path, name, fmt, compression, text_field, skipped)
    if damaged is not None and sum(skipped[r] for r in DAMAGE_REASONS) > before:
        damaged.append(name)  # (not reached when the caller stops early, --max-docs: nothing was found)
