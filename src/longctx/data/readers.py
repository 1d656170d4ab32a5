"""Reading and normalising input documents: directories of text files, `.jsonl`, `.parquet`, `stdlib`.

Every input yields `Document(name, text)`; the name is stable (a path relative to the input
directory, or `file.jsonl:LINE`), because the train/eval split hashes it. Text is normalised:
UTF-8 BOM dropped, CRLF/CR line ends turned into LF, Unicode NFC.

Bad input never stops a build half-way: an empty or whitespace-only document, a binary file (a NUL
byte in its first 8 KiB), invalid UTF-8, an unparsable JSON line or a record without the text
field is skipped and counted under its reason. What cannot be read at all (a missing path, an
input directory with no usable file, a parquet file without the column, pyarrow missing) is a
`DataError` before any output is written.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .corpus import TEXT_SUFFIXES, Document, corpus_files

STRUCTURED_SUFFIXES = {".jsonl", ".parquet"}


@dataclass
class ReadResult:
    docs: list[Document]
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    files: int = 0
    bytes: int = 0  # raw bytes of the documents kept (UTF-8)


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


def _read_text_file(path: Path, name: str, out: ReadResult) -> None:
    try:
        raw = path.read_bytes()
    except OSError:
        out.skipped["unreadable"] += 1
        return
    text, why = decode(raw)
    if why:
        out.skipped[why] += 1
    else:
        out.docs.append(Document(name, text))


def _accept(text, why_missing: str, out: ReadResult, name: str) -> None:
    if not isinstance(text, str):
        out.skipped[why_missing] += 1
        return
    if "\x00" in text[:8192]:
        out.skipped["binary"] += 1
        return
    text = normalise(text)
    if not text.strip():
        out.skipped["empty"] += 1
        return
    out.docs.append(Document(name, text))


def _read_jsonl(path: Path, name: str, text_field: str, out: ReadResult) -> None:
    try:
        raw = path.read_bytes()
    except OSError:
        out.skipped["unreadable"] += 1
        return
    for i, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            out.skipped["bad_json_line"] += 1
            continue
        if not isinstance(record, dict):
            out.skipped["bad_json_line"] += 1
            continue
        _accept(record.get(text_field), "missing_text_field", out, f"{name}:{i}")


def _read_parquet(path: Path, name: str, text_field: str, out: ReadResult) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading '{path}' needs pyarrow, which is not installed; install the data extra with "
            f"pip install 'longctx[data]' (or pip install pyarrow)."
        ) from None
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises several types for a corrupt file
        out.skipped["bad_parquet_file"] += 1
        del e
        return
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"parquet file '{path}' has no column '{text_field}' (columns: {', '.join(pf.schema_arrow.names)}); "
            f"pass --text-field with the column that holds the document text."
        )
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            row += 1
            _accept(value, "missing_text_field", out, f"{name}:{row}")


def input_files(spec: str, option: str = "--input") -> tuple[Path, list[Path], int]:
    """(root, the files read_inputs reads for `spec`, sorted; files skipped for their suffix):
    'stdlib', a directory (text, .jsonl and .parquet files; dotfiles skipped) or one file.
    `option` names the setting `spec` came from in errors (--input, data.corpus)."""
    if spec == "stdlib":
        return (*corpus_files("stdlib"), 0)
    p = Path(spec)
    if not p.exists():
        raise DataError(f"{option} '{spec}' does not exist: it is neither 'stdlib' nor an existing directory or "
                        f"file; pass a directory of text files, a .jsonl or .parquet file, or 'stdlib'.")
    if not p.is_dir():
        return p.parent, [p], 0
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    usable = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES | STRUCTURED_SUFFIXES]
    if not usable:
        raise DataError(
            f"{option} directory '{spec}' holds no usable file (text files with a suffix among "
            f"{', '.join(sorted(TEXT_SUFFIXES))}, or .jsonl / .parquet); point {option} at a directory "
            f"with documents."
        )
    return p, usable, len(files) - len(usable)


def read_inputs(inputs: list[str], text_field: str = "text", max_docs: int = 0) -> ReadResult:
    """All documents of all inputs, in a deterministic order (inputs as given, files sorted)."""
    out = ReadResult(docs=[])
    if not inputs:
        raise DataError("no input given; pass --input with a directory, a .jsonl or .parquet file, or 'stdlib'.")
    for spec in inputs:
        root, files, other = input_files(spec)
        out.skipped["other_suffix"] += other
        for f in files:
            out.files += 1
            name = f.relative_to(root).as_posix()
            suffix = f.suffix.lower()
            if suffix == ".jsonl":
                _read_jsonl(f, name, text_field, out)
            elif suffix == ".parquet":
                _read_parquet(f, name, text_field, out)
            else:
                _read_text_file(f, name, out)
            if max_docs and len(out.docs) >= max_docs:
                del out.docs[max_docs:]
                break
        if max_docs and len(out.docs) >= max_docs:
            break
    out.bytes = sum(len(d.text.encode("utf-8")) for d in out.docs)
    return out
