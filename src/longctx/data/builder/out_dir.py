"""What an existing `--out` may hold, checked before a build, append, shard scan or merge writes into it.

A build cleans up after interrupted builds in its --out: it removes `part-*` directories its manifest
does not list, `.tmp-part-*` and the work directory `.build`; a shard scan started over removes its
whole --out. That is right in a directory only builds wrote, and loses a user's files anywhere else
(a `part-notes/` or a project's `.build/` in a directory given as --out by mistake). So an --out that
exists must be new or empty, a store (whose manifest decides: --append or refused), or hold only what
an unfinished build or scan of this kind leaves; anything else is refused, naming what is there.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...durable import file_in_the_way
from ...errors import DataError
from .. import store

WORK = ".build"  # a build's scan directory inside --out (pipeline.py)
# what a store directory holds, also while a build or append is unfinished (store.py, durable.py)
_STORE = re.compile(r"^(manifest\.json|part-\d{5}|\.tmp-part-\d{5}-\d+|\.manifest\.json\.tmp-\d+|\.build)$")
# what a scan directory holds: scan.py's plan (and its temporary) and shards
_SCAN = re.compile(r"^(plan\.json|\.plan\.json\.tmp-\d+|shards)$")
# a store's work directory: a scan, and the embeddings a build or merge writes beside it (embed.py)
_WORK = re.compile(r"^(plan\.json|\.plan\.json\.tmp-\d+|shards|emb\.npy)$")


def foreign_entries(out: Path, scan_dir: bool = False) -> list[str]:
    """Entries of an existing `out` that no build (`scan_dir`: no shard scan) writes there; [] for a store."""
    if not out.is_dir() or (not scan_dir and (out / store.MANIFEST).is_file()):
        return []
    allowed = _SCAN if scan_dir else _STORE
    found = [p.name for p in out.iterdir() if not allowed.match(p.name)]
    work = out / WORK
    if not scan_dir and work.exists():
        found += [f"{WORK}/{p.name}" for p in work.iterdir() if not _WORK.match(p.name)] if work.is_dir() else [WORK]
    return sorted(found)


def check_out(out: Path, scan_dir: bool = False) -> None:
    """Refuse an `out` that is a file, lies under one, or holds files no build wrote (foreign_entries)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out '{out}' exists and is not a directory.")
    above = file_in_the_way(out)
    if above is not None:
        raise DataError(f"--out '{out}' lies under '{above}', which is a file, not a directory; choose a directory.")
    foreign = foreign_entries(out, scan_dir)
    if foreign:
        kind = "shard scan" if scan_dir else "data store"
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise DataError(f"--out '{out}' holds files that are not a {kind}'s ({', '.join(foreign[:5])}{more}); a "
                        f"build removes what it finds there under its own names, so it writes only into a new or "
                        f"empty directory, a store, or an unfinished build of its own. Choose another --out.")


def check_parts(root: Path, manifest: dict) -> None:
    """Every part the store's manifest lists is there with the files an append dedups against, checked
    before the scan: a store that lost one is refused now, not after the inputs were read."""
    missing = [f"{p['dir']}/hashes.npy" for p in manifest.get("parts", []) if not (root / p["dir"] / "hashes.npy")
               .is_file()]
    if missing:
        raise DataError(f"the store '{root}' is damaged: {', '.join(missing[:3])} is missing, so an append cannot "
                        f"leave out the documents it holds. Rebuild the store (all its inputs) into a new --out.")
