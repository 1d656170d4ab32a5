"""How far the scan has read, counted within a file as it is read (scan.py; the scan stage's progress phase).

A shard's count used to move only when it was done, and a shard is at least one file: the build of one
131 MB JSONL file said "0/131 MB" for minutes. Now the scan of a shard says the bytes of its files read so far
(on disk: a compressed file's, readers.ReadPosition) every REPORT_S, checked at each document, into one slot
per shard of `ShardsRead`: shared memory that the worker processes write and the parent sums whenever its
phase is said (Phase.follow), or plain memory where the shards are scanned in this process.
"""

from __future__ import annotations

import time

import numpy as np

from .readers import ReadPosition
from .scan_pool import worker_context

REPORT_S = 1.0  # seconds between two counts of a shard's bytes read (at most; checked at each document)


class ShardsRead:
    """The bytes read of each of `shards` shards, shared with the scan's worker processes when there are any."""

    def __init__(self, shards: int, workers: int = 1):
        self.raw = worker_context().RawArray("q", max(shards, 1)) if workers > 1 else None
        self.array = np.frombuffer(self.raw, np.int64) if self.raw is not None else np.zeros(max(shards, 1), np.int64)

    def total(self) -> int:
        return int(self.array.sum())

    def done(self, index: int, size: int) -> None:
        """Shard `index` is done: all its `size` bytes counted (a shard stopped early, --max-docs, too)."""
        self.array[index] = size

    def setter(self, index: int):
        def read(n: int) -> None:
            self.array[index] = n
        return read


_SHARED: np.ndarray | None = None  # in a worker process: its parent's ShardsRead, over the same memory


def in_worker(raw) -> None:
    """A worker process's initializer: its shards' counts go to `raw` (a ShardsRead's shared memory)."""
    global _SHARED
    _SHARED = None if raw is None else np.frombuffer(raw, np.int64)


def worker_setter(index: int):
    """What a worker counts shard `index`'s bytes read with (None: nothing shared)."""
    if _SHARED is None:
        return None
    shared = _SHARED

    def read(n: int) -> None:
        shared[index] = n
    return read


class ShardReport:
    """The bytes read of one shard's files, said to `on_read(bytes)` at most every REPORT_S while a file is
    read and once as each file is done. `position`: what iter_file keeps the place of its file in."""

    def __init__(self, on_read):
        self.on_read, self.before = on_read, 0
        self.position = ReadPosition()
        self.last = time.monotonic()

    def document(self) -> None:
        if self.on_read is not None and time.monotonic() - self.last >= REPORT_S:
            self.on_read(self.before + self.position.tell())
            self.last = time.monotonic()

    def unit_done(self, size: int) -> None:
        self.before += size
        self.position = ReadPosition()
        if self.on_read is not None:
            self.on_read(self.before)
            self.last = time.monotonic()
