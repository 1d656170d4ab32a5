"""A checkpoint save that failed: what the job's state weighs, and the message that says so.

Kept apart from manager.py (which decides when a save failed and cleans up after it) so that the
manager stays about saving and loading.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from ..config.checkpoint_paths import CheckpointError, latest_checkpoint


def state_bytes(state) -> float:
    """Bytes of this rank's tensors in a state dict (its shards of DTensors): what it writes."""
    total = 0.0
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def save_failed(root: Path, step: int, needed: float, error: Exception | None) -> CheckpointError:
    """The error every rank raises: the step, the cause (this rank's, or another's), the job's bytes
    against the free space, and what is kept."""
    try:
        free = f"{shutil.disk_usage(root).free / 2**30:.2f} GiB free there"
    except OSError:
        free = "its free space unknown"
    # (the one `latest` names: the newest in the directory may be an abandoned attempt's, after an explicit resume)
    found = latest_checkpoint(root) if root.is_dir() else None
    kept = (f"the previous checkpoint, {found.name}, is intact and `latest` still points to it"
            if found is not None else "no earlier checkpoint exists")
    what = f"{error}" if error is not None else "another rank's write failed"
    return CheckpointError(f"the checkpoint of step {step} could not be written to {root} ({what}); it needs about "
                           f"{needed / 2**30:.2f} GiB ({free}). The partial save was removed and {kept}.")
