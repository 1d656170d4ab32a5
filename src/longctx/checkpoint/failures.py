"""A checkpoint save that failed: what the job's state weighs, and the message that says so.

Kept apart from manager.py (which decides when a save failed and cleans up after it) so that the
manager stays about saving and loading.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils._pytree import tree_leaves

from ..config.checkpoint_paths import CheckpointError, latest_checkpoint

# what a failed write raises: DCP wraps its ranks' errors (a full disk: torch.save's "unexpected pos") in a
# CheckpointException, a BaseException, which `except Exception` let through as a raw traceback that left the
# partial save filling the disk
SAVE_ERRORS = (Exception, CheckpointException)


def state_bytes(state) -> float:
    """Bytes of this rank's tensors in a state dict (its shards of DTensors): what it writes."""
    total = 0.0
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def save_failed(root: Path, step: int, needed: float, error: BaseException | None,
                own: Path | None) -> CheckpointError:
    """The error every rank raises: the step, the cause (this rank's, or another's), the job's bytes
    against the free space, and what is kept. `own`: the checkpoint the run committed or loaded last (None: it
    has none), which a run that resumed an older one (or one elsewhere) and committed none since does not find
    in `latest`: that names another attempt's (or run's), which the message called the previous checkpoint and
    sent resume auto to, continuing that attempt's weights."""
    try:
        free_bytes = shutil.disk_usage(root).free
        free = f"{free_bytes / 2**30:.2f} GiB free there" + (", less than it needs: the disk is full"
                                                             if free_bytes < needed else "")
    except OSError:
        free = "its free space unknown"
    # (the one `latest` names: the newest in the directory may be an abandoned attempt's, after an explicit resume)
    latest = latest_checkpoint(root) if root.is_dir() else None
    # (how to get past it: said nothing, so a full disk stopped a long run with no way out named)
    # (auto looks in --checkpoint.dir: a new one holds no checkpoint, so that resume names the kept one's path)
    if own is None:
        kept, resume = ("no earlier checkpoint exists" if latest is None else
                        f"this run has saved no checkpoint yet (`latest` names {latest.name}, not this run's)"), ""
    elif latest is not None and own.resolve() == latest.resolve():
        kept = f"the previous checkpoint, {own.name}, is intact and `latest` still points to it"
        resume = (f"; --checkpoint.resume auto then continues from {own.name} (with another --checkpoint.dir, "
                  f"--checkpoint.resume {own})")
    else:
        other = f" (`latest` names {latest.name}, another attempt's: resume auto would continue that one)"
        kept = f"this run's previous checkpoint, {own}, is intact" + (other if latest is not None else "")
        resume = f"; --checkpoint.resume {own} then continues this run"
    what = _cause(error) if error is not None else "another rank's write failed"
    return CheckpointError(f"the checkpoint of step {step} could not be written to {root} ({what}); it needs about "
                           f"{needed / 2**30:.2f} GiB ({free}). The partial save was removed and {kept}. To fix it: "
                           f"free space there (a save needs room for one more checkpoint beside those "
                           f"--checkpoint.keep keeps), fix the cause named above (e.g. a directory that is not "
                           f"writable), or point --checkpoint.dir at a disk with room{resume}.")


def _cause(error: BaseException) -> str:
    """The error, said in one line: a DCP CheckpointException's str is every failed rank's whole traceback."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _trace) in
                         sorted(error.failures.items())) or "DCP's write failed"
    return f"{error}"
