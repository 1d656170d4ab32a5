"""An explicit `--checkpoint.resume <run>/checkpoints/step-N` of a step a killed re-save left moved aside.

A re-save of a step (a resume of an older checkpoint saving that step again) moves the complete step-N aside
(.tmp-old-step-N-<hex>) and publishes the new one only then; a kill between left step-N only there. The next start
of the run puts it back (checkpoint/retention.py sweep_leftovers, in the checkpoint manager, under the run lock),
so `--checkpoint.resume auto` found it; an explicit PATH was resolved before that, and refused ("no complete
checkpoint there") though the step is whole one rename away. Here it is put back by the same code before anything
resolves the PATH (`longctx train`'s launching process before it builds the config; the Trainer's rank 0 before it
checks the run directory), under the lock of its directory (run_lock.py), released at once: the run takes its own
later. A directory a live `longctx train` holds is never touched (its re-save of that step may be committing now):
refused, saying where the step is and how to recover. A checkpoints directory (or its `latest`) whose `latest` names
such a step is the same resume (another run's: this run's start never sweeps it, and the older step before it was
resumed); a step that cannot be renamed (another user's run, a read-only copy) is refused in words.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..checkpoint.retention import put_back
from ..config.checkpoint_paths import CheckpointError, moved_aside, named_step
from ..errors import ConfigError
from .run_lock import RunLock


def put_back_resumed(spec, log=print) -> Path | None:
    """Put back the step `--checkpoint.resume spec` names when a killed re-save left it moved aside: the step
    directory put back (None: nothing to do, `spec` is auto or none, the step is there, or none is moved aside)."""
    if not isinstance(spec, str) or spec in ("auto", "none"):
        return None
    path = named_step(spec)
    if moved_aside(path) is None:
        return None
    lock = RunLock()
    try:
        lock.take(path.parent, "checkpoint.dir")
    except OSError as e:  # (a directory this user may not open)
        raise _cannot_put_back(spec, path, e) from None
    except ConfigError:
        raise CheckpointError(
            f"--checkpoint.resume {spec}: {path.name} is not there: it is moved aside as {moved_aside(path)} by a "
            f"re-save of that step, and {path.parent} is in use by a `longctx train` that is still running (it holds "
            f"the directory's lock), which may be committing a new one in its place now. "
            f"Nothing was changed. Resume once that run has ended: its new {path.name} then, or, where it ended "
            f"before publishing one, this same command puts the old one back.") from None
    try:
        old = moved_aside(path)  # (again under the lock: another start may have put it back meanwhile)
        restored = put_back(old) if old is not None else None
    except OSError as e:  # (another's run, or a read-only copy: the rename is not this user's to make)
        raise _cannot_put_back(spec, path, e) from None
    finally:
        lock.release()
    if restored is not None:
        log(f"checkpoint: put back {restored}, which a re-save of its step, killed before it committed, had left "
            f"moved aside as {old.name}")
    return restored


def _cannot_put_back(spec: str, path: Path, e: OSError) -> CheckpointError:
    old = moved_aside(path)
    mv = f"mv {shlex.quote(str(old))} {shlex.quote(str(path))}"
    return CheckpointError(
        f"--checkpoint.resume {spec}: {path.name} is moved aside as {old} by a re-save of that step that did not "
        f"commit, and could not be put back ({e.strerror or e}); nothing was changed. Put it back as a user who may "
        f"write in {path.parent} ({mv}), or copy {old} to a directory of your own named {path.name} and resume "
        f"that copy.")
