"""A build, append or merge that ran out of disk space, said as what it is: the directory, the space free
there, what the build needs there in all, and that nothing was published.

A full disk surfaced as the OSError of whichever write hit it ("[Errno 28] No space left on device", a
traceback, no path: a part's file or a scan worker's), which left the user to guess where and how much
to free. The space needed is an estimate from the shards scanned so far (scan.py), scaled to the whole
input: their own files, which stay until the store is written, then the store's part (its tokens padded
to samples, about a tenth more), its per-document files and the embeddings (up to ~1.6 KB a document).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np

from ...errors import DataError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
PER_DOCUMENT = 100  # a stored document's line of docs.jsonl and its hash, in bytes
SIGNATURE = 1024  # its MinHash signature (--dedup minhash)
EMBEDDING = 512  # its embedding, while a datasculpt build packs
PADDING = 1.1  # a part's tokens over the documents' (samples end in padding; fill rates are 0.9 and up)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in NO_SPACE


def disk_full_error(e: OSError, out: Path, need: int | None, append: bool) -> DataError:
    """The DataError for `e` (a full disk or quota) while writing into `out`; `need`: the bytes the build needs
    there in all (None: unknown)."""
    try:
        free = f"{_mb(shutil.disk_usage(out).free)} is free there now"
    except OSError:
        free = "its free space could not be read"
    needs = f"; the build needs about {_mb(need)} there in all (its scan, then the store)" if need else ""
    kept = "the store is as it was" if append else f"'{out}' is not a store"
    return DataError(f"the disk holding '{out}' is full: a write there failed ({e.strerror or e}); {free}{needs}. "
                     f"Nothing was published ({kept}). Free space there, or choose an --out on a disk with room, and "
                     f"run the same command again: the input shards already scanned are kept and not read again.")


def space_needed(shard_dirs: list[Path], shards: int, input_bytes: int, token_itemsize: int, per_document: int,
                 scan_in_out: bool) -> int | None:
    """Bytes a build needs in its --out: its scan's files (`scan_in_out`: they lie there, not in a merge's scan
    directories) and the store's part, from the complete shards among `shard_dirs` (of `shards` in all), scaled
    from the text they read to `input_bytes` where some are not. None before any shard is complete."""
    scanned = text = tokens = documents = complete = 0
    for d in shard_dirs:
        try:
            counts = json.loads((d / "shard.json").read_text())
            tokens += int(np.load(d / "tokens.offsets.npy", mmap_mode="r")[-1])
        except (OSError, ValueError, IndexError):
            continue  # (not complete, or damaged: its share is scaled from the others)
        complete += 1
        text += int(counts["bytes"])
        documents += int(counts["documents"])
        scanned += sum(f.stat().st_size for f in d.iterdir() if f.is_file()) if scan_in_out else 0
    if not text:
        return None
    # (the text they read against the inputs' size on disk: an underestimate for compressed inputs)
    scale = 1.0 if complete >= shards else max(1.0, input_bytes / text)
    return int(scale * (scanned + tokens * token_itemsize * PADDING + documents * per_document))


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def shard_dirs(scan_dir: Path) -> list[Path]:
    """The shard directories (complete or not) of a scan directory."""
    shards = scan_dir / "shards"
    return sorted(p for p in shards.iterdir() if not p.name.startswith(".")) if shards.is_dir() else []


def token_itemsize(plan: dict) -> int:
    return np.dtype(plan.get("token_dtype", "uint32")).itemsize


def per_document(plan: dict) -> int:
    """Bytes a stored document takes besides its tokens, under the build options of a scan's `plan`."""
    build = plan.get("build", {})
    return (PER_DOCUMENT + (SIGNATURE if build.get("dedup") == "minhash" else 0)
            + (EMBEDDING if build.get("strategy", "datasculpt") == "datasculpt" else 0))


def input_bytes(plan: dict) -> int:
    return int(plan.get("bytes", 0))
