"""One live run per run directory (and checkpoint directory): a second `longctx train` on it is refused.

A second run started on a run directory while the first still trains (a scheduler's requeue while the old
job is in its grace period, a command run twice) did not fail: at its start it swept the first's save in
flight as a killed save's leftovers (its hidden step directory, its `latest` being written: the first then
failed its commit), moved the first's newer metrics records aside and replaced metrics.jsonl under it (the
first's later lines went to the file it still had open, no longer in the directory: lost), and from then on
both committed step directories and `latest` over each other's. Rank 0 holds a lock on each directory
(flock on the directory itself: no file left behind, released when the process ends, a kill included)
from before anything in them is touched until the run ends. The same process may take it again (a library
caller's Trainers one after the other, which never run at once).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..durable import DirectoryInUse, lock_directory
from ..errors import ConfigError

_held: dict[str, list[int]] = {}  # directory (real path) -> [fd, holders in this process]


class RunLock:
    """The directories this run holds (take), until release()."""

    def __init__(self):
        self.paths: list[str] = []

    def take(self, directory: Path, what: str) -> None:
        """Hold `directory` (it exists) for this run, or raise ConfigError when another process holds it.
        A file system without locks (some network mounts) is left unguarded, as before."""
        key = os.path.realpath(directory)
        if key in self.paths:
            return
        if key not in _held:
            try:
                fd = lock_directory(key)
            except DirectoryInUse:
                raise ConfigError(
                    f"{what} {directory} is in use by another `longctx train` that is still running (it holds the "
                    f"directory's lock); nothing was changed. Wait for it to end (a preempted run saves and exits), "
                    f"or stop it first; two runs in one directory would delete each other's saves in flight and "
                    f"write their checkpoints and metrics over each other's.") from None
            if fd is None:  # (a file system without locks: unguarded, as before)
                return
            _held[key] = [fd, 0]
        _held[key][1] += 1
        self.paths.append(key)

    def release(self) -> None:
        for key in self.paths:
            entry = _held.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del _held[key]
                os.close(entry[0])  # (releases the lock)
        self.paths.clear()

    def __del__(self):  # (a Trainer built and dropped without run(): its directories are let go with it)
        try:
            self.release()
        except Exception:  # (at interpreter shutdown the module's globals may be gone: the process lets go anyway)
            pass
