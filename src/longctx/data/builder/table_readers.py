"""Parquet and Arrow units (readers.py iter_file reads the rest): their record batches' columns made documents
ROWS values at a time, a corrupt file counted under its skip reason, a missing or non-text column a DataError;
pyarrow, the optional package they need, imported when one is read (data_extra: any of the `data` extra's packages)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from ...errors import DataError
from .corpus import Document

ROWS = 4096  # parquet / arrow values converted to Python at a time


def data_extra(package: str, path: Path, *parts: str):
    """`package`, one of the `data` extra's optional packages (with its submodules `parts`), imported to read `path`;
    a DataError naming how to install it where it is missing (through the import statement's own __import__)."""
    try:
        module = __import__(package)
        for part in parts:
            __import__(f"{package}.{part}")
    except ImportError:
        raise DataError(
            f"reading '{path}' needs {package}, which is not installed; install the data extra with "
            f"pip install 'longctx[data]' (or pip install {package})."
        ) from None
    return module


def import_pyarrow(path: Path):
    return data_extra("pyarrow", path, "ipc", "parquet")


def _column_problem(kind: str, path: Path, fields: list[tuple], schema) -> DataError | None:
    """The error for a parquet / arrow file without one of the record's columns `fields` ((name, the
    option naming it, what it holds) each), or whose text column holds no strings (bytes, numbers: every row
    would be skipped as having no text, the column right there)."""
    columns = schema.names
    for field, flag, holds in fields:
        if field not in columns:
            nested = ("; a dotted name reads a nested field in .jsonl only: flatten the table's struct columns "
                      "(pyarrow's Table.flatten() names them 'a.b') and write it again" if "." in field
                      and field.split(".")[0] in columns else "")
            return DataError(f"{kind} file '{path}' has no column '{field}' (columns: {', '.join(columns)}); "
                             f"pass {flag} with the column that holds the {holds}{nested}.")
        if len(schema.get_all_field_indices(field)) > 1:  # (which one is the text: not ours to guess)
            return DataError(f"{kind} file '{path}' has {len(schema.get_all_field_indices(field))} columns named "
                             f"'{field}'; rename all but the one that holds the {holds}.")
        kind_of = schema.field(field).type
        # (a dictionary-encoded column: its values' type; a list column has a value_type too, and is no text)
        value_type = kind_of.value_type if hasattr(kind_of, "index_type") else kind_of
        if holds != "conversation" and not (str(value_type) in _STRING_TYPES or str(kind_of) == "null"):
            return DataError(f"{kind} file '{path}' column '{field}' holds {kind_of} values, not text (string); "
                             f"pass {flag} with the column that holds the {holds} as strings, or convert it.")
    return None


_STRING_TYPES = ("string", "large_string", "string_view")


def _iter_values(batches: Iterator, columns: list, accept, name: str, skipped: Counter,
                 reason: str, rows_read=None) -> Iterator[Document]:
    """Documents of the `columns` (indices, the record's fields in order) of record batches, each row's
    values made a document by `accept`; a batch that cannot be read ends the unit, counted under `reason`.
    `rows_read(n)`, if given, is told the rows read so far (progress)."""
    row = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception:  # pyarrow raises several types for corrupt data
            skipped[reason] += 1
            return
        values = [batch.column(c) for c in columns]
        for start in range(0, len(values[0]), ROWS):
            for fields in zip(*(v.slice(start, ROWS).to_pylist() for v in values)):
                row += 1
                if rows_read is not None:
                    rows_read(row)
                doc = accept(list(fields), f"{name}:{row}", skipped)
                if doc is not None:
                    yield doc


def iter_parquet(path: Path, name: str, fields: list[tuple], accept, skipped: Counter,
                 position) -> Iterator[Document]:
    """(`position`: readers.ReadPosition, moved by the rows read)"""
    pq = import_pyarrow(path).parquet
    try:
        pf = pq.ParquetFile(str(path))
    except Exception:  # pyarrow raises several types for a corrupt file
        skipped["bad_parquet_file"] += 1
        return
    problem = _column_problem("parquet", path, fields, pf.schema_arrow)
    if problem is not None:
        raise problem
    rows_read = position.at_rows(pf.metadata.num_rows, path.stat().st_size)
    yield from _iter_values(pf.iter_batches(columns=[f for f, _, _ in fields], batch_size=ROWS),
                            list(range(len(fields))), accept, name, skipped, "bad_parquet_file", rows_read)


def iter_arrow(path: Path, name: str, fields: list[tuple], accept, skipped: Counter,
               position) -> Iterator[Document]:
    """(`position`: readers.ReadPosition, at the memory map's place)"""
    pa = import_pyarrow(path)
    try:
        source = pa.memory_map(str(path))  # batches are read in place, not copied into memory
    except OSError:
        skipped["unreadable"] += 1
        return
    position.at_file(source)
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
        problem = _column_problem("arrow", path, fields, schema)
        if problem is not None:
            raise problem
        yield from _iter_values(batches, [schema.get_field_index(f) for f, _, _ in fields], accept, name, skipped,
                                "bad_arrow_file")
