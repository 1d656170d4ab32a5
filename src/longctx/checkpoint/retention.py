"""Which step directories a checkpoints directory keeps (checkpoint/manager.py calls both): keep-last pruning
after each commit, along the run's own trajectory, and at a start the leftovers of saves, commits and prunes a
kill interrupted (a complete step a re-save had moved aside put back; hidden temporaries removed)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..config.checkpoint_paths import MANIFEST, MOVED_ASIDE, moved_from, trajectory

_PRUNED = ".tmp-pruned-"  # a step directory keep-last is deleting (swept with the other .tmp-* at the next start)


def sweep_leftovers(root: Path) -> None:
    """At a start (rank 0): what a killed save, commit or prune left in `root`."""
    for old in sorted(root.glob(f"{MOVED_ASIDE}step-*")):  # a commit killed after moving a complete step aside
        put_back(old)  # (and before publishing its new one)
    for stale in root.glob(".tmp-*"):  # leftovers of saves that never completed
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".*.tmp-*"):  # a `latest` (durable.py) a killed process left
        if stale.is_file():
            stale.unlink(missing_ok=True)


def moved_aside_name(final: Path) -> Path:
    """Where a re-save of `final`'s step moves the old one until the new one is published (put_back, moved_from)."""
    return final.parent / f"{MOVED_ASIDE}{final.name}-{uuid.uuid4().hex[:8]}"


def put_back(old: Path) -> Path | None:
    """A complete step directory a re-save moved aside (`old`: .tmp-old-step-N-<hex>) back under its name, when that
    is free: the step directory (None: left as it is). The caller holds the directory's run lock (train/run_lock.py:
    a live run's re-save may be committing); sweep_leftovers, and an explicit resume of it (train/moved_aside.py)."""
    final = moved_from(old)
    if not (old.is_dir() and (old / MANIFEST).is_file()) or final.exists():
        return None
    os.replace(old, final)
    return final


def prune(root: Path, keep: int, keep_also: Path) -> None:
    # the `keep` newest of this run's trajectory (the one just saved and those it descends from): another
    # attempt's, which an explicit resume of an older checkpoint left newer or interleaved, are neither counted
    # nor deleted (counting them deleted this run's own history). Oldest first, each renamed away before rmtree:
    # a kill inside rmtree left a damaged step-* that looked complete, or remains no prune ever removed
    for old in reversed(trajectory(root, keep_also)[keep:] if keep else []):
        doomed = root / f"{_PRUNED}{old.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(old, doomed)
        except OSError:  # (gone already, or not ours to move: left as it is)
            continue
        shutil.rmtree(doomed, ignore_errors=True)
