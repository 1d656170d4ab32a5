"""Arrays written and read piece by piece, so that a build's memory does not grow with its corpus.

- `NpyAppender`: a `.npy` file whose rows are appended as they are produced; the header is written
  last (its space is reserved up front), so the file is an ordinary array for `np.load`.
- `RaggedWriter` / `RaggedReader`: one variable-length 1-D array per item (a document's text
  bytes, tokens, line breaks, ...): the values concatenated in `NAME.bin`, item i's bounds at
  `offsets[i]:offsets[i + 1]` in `NAME.offsets.npy`. Reads use `os.pread` (read_at), not a memory map: the
  pages of a memory map count towards the reader's resident memory until the kernel drops them,
  and a build reads its whole corpus back.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

HEADER_BYTES = 128  # what numpy writes for any 1-D or 2-D shape of up to ~20-digit dimensions


def _header(dtype, shape) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
    head = buf.getvalue()
    if len(head) != HEADER_BYTES:  # cannot happen for shapes of realistic sizes; never write a broken file
        raise ValueError(f"npy header of {len(head)} bytes for shape {shape}, expected {HEADER_BYTES}")
    return head


class NpyAppender:
    """Rows of shape `row_shape` appended to `path`; `close()` writes the header and returns the row count."""

    def __init__(self, path: str | Path, dtype, row_shape: tuple = ()):
        self.path, self.dtype, self.row_shape = Path(path), np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self.f = open(self.path, "wb")
        self.f.write(b"\0" * HEADER_BYTES)

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"rows of shape {rows.shape[1:]} appended to {self.path}, expected {self.row_shape}")
        self.f.write(rows.tobytes())
        self.rows += len(rows)

    def mark(self) -> tuple[int, int]:
        return self.f.tell(), self.rows

    def rollback(self, mark: tuple[int, int]) -> None:
        """Drop the rows appended since `mark`."""
        self.f.seek(mark[0])
        self.f.truncate()
        self.rows = mark[1]

    def close(self) -> int:
        self.f.seek(0)
        self.f.write(_header(self.dtype, (self.rows, *self.row_shape)))
        self.f.close()
        return self.rows


class RaggedWriter:
    def __init__(self, prefix: str | Path, dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self.f = open(f"{self.prefix}.bin", "wb")
        self.offsets = [0]

    def append(self, values) -> None:
        if isinstance(values, (bytes, bytearray)):
            data = bytes(values)
            n = len(data) // self.dtype.itemsize
        else:
            arr = np.ascontiguousarray(values, dtype=self.dtype)
            data, n = arr.tobytes(), arr.size
        self.f.write(data)
        self.offsets.append(self.offsets[-1] + n)

    def mark(self) -> tuple[int, int]:
        return self.f.tell(), len(self.offsets)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Drop the items appended since `mark`."""
        self.f.seek(mark[0])
        self.f.truncate()
        del self.offsets[mark[1]:]

    def close(self) -> None:
        self.f.close()
        np.save(f"{self.prefix}.offsets.npy", np.asarray(self.offsets, dtype=np.int64))


def ragged_lengths(prefix: str | Path) -> np.ndarray:
    """Each item's length in values, from the offsets alone (no data file opened)."""
    return np.diff(np.load(f"{prefix}.offsets.npy"))


def ragged_rows(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items `rows` of a ragged array (`offsets` into `values`) as a ragged array of their own."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.diff(offsets)[rows]
    out = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    at = np.repeat(offsets[rows] - out[:-1], lengths) + np.arange(int(out[-1]))
    return out, values[at]


def read_at(fd: int, count: int, offset: int) -> bytes:
    """`count` bytes of `fd` from `offset`: one os.pread returns at most 0x7ffff000 bytes on Linux (a
    document's text over 2 GiB came back short, without an error), so it reads until all are in."""
    parts, done = [], 0
    while done < count:
        part = os.pread(fd, count - done, offset + done)
        if not part:
            raise OSError(f"read {done} of {count} bytes at offset {offset}: the spill file ends early")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


class RaggedReader:
    def __init__(self, prefix: str | Path, dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self.offsets = np.load(f"{self.prefix}.offsets.npy")
        self.fd = os.open(f"{self.prefix}.bin", os.O_RDONLY)

    def raw(self, i: int, start: int = 0, stop: int | None = None) -> bytes:
        """Item i's values [start, stop) as bytes."""
        lo = int(self.offsets[i])
        hi = int(self.offsets[i + 1])
        a = lo + start
        b = hi if stop is None else min(hi, lo + stop)
        size = self.dtype.itemsize
        return read_at(self.fd, (b - a) * size, a * size) if b > a else b""

    def get(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.frombuffer(self.raw(i, start, stop), dtype=self.dtype)

    def close(self) -> None:
        os.close(self.fd)
