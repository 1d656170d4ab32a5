"""Writes that survive a power loss, not only a crash of the process.

A rename publishes data atomically for readers, but after a power loss the file system may hold the
new name with the old (or no) contents: the data must reach the disk (fsync) before the rename that
publishes it, and the directory holding the new name after it. Checkpoints and the packed-data store
publish this way.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a directory's entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` (a file or a directory whose files are synced already) to `final`, durably: its
    entries before the rename, the parent's after it."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Replace `path`'s contents with `text` atomically and durably (a temporary file, synced, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk: no half-written file left behind)
        raise


def file_in_the_way(directory: Path) -> Path | None:
    """The file that keeps `directory` from being made (`directory` itself, or the nearest existing of its
    parents when that is a file), else None. Commands check it before their work: otherwise they fail
    only where they create the directory, after reading weights or training a step."""
    directory = Path(directory).expanduser()
    nearest = next((p for p in (directory, *directory.parents) if p.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None
