"""train.on_nonfinite = rollback: what was skipped, kept beside the checkpoints.

A bad step (non-finite, or a loss spike) found at step B, with the newest checkpoint at step C < B:
the run reloads C's weights and optimizer, takes the data position it had after step B, and goes on
at step B + 1. The data of steps C+1..B (the window that led to the bad step) is never trained on,
and steps B+1.. see the data they would have seen. The choice is recorded in `rollbacks.jsonl` in
the checkpoint directory (the run directory's checkpoints/ by default): one JSON line per
rollback, written before training goes on, so that a resume from C, after a crash before the
next save, continues at B + 1 with the same data instead of replaying the window.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RECORD = "rollbacks.jsonl"


def record_rollback(root: Path, bad_step: int, checkpoint_step: int, reason: str, data_position: dict) -> None:
    """Append one rollback (rank 0 only; flushed to disk before the run goes on)."""
    entry = {"bad_step": bad_step, "rolled_back_to": checkpoint_step, "skipped_steps": [checkpoint_step + 1, bad_step],
             "reason": reason, "data_position": data_position, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    root.mkdir(parents=True, exist_ok=True)
    with open(root / RECORD, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def rollback_from(root: Path, checkpoint_step: int) -> dict | None:
    """The newest rollback to the checkpoint of `checkpoint_step` (None when the run never rolled
    back to it): a resume from that checkpoint continues after its bad step instead."""
    path = root / RECORD
    if not checkpoint_step or not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut by a crash while it was written: that rollback did not go on
            continue
        if entry.get("rolled_back_to") == checkpoint_step:
            found = entry
    return found


def skip_rolled_back_window(root: Path, start_step: int, sampler) -> tuple[int, str | None]:
    """A resume from a checkpoint the run once rolled back to continues after the bad step, with
    the data it had then, instead of replaying the skipped window: (the step to start after, what
    to log); unchanged when the checkpoint was no rollback's."""
    skipped = rollback_from(root, start_step)
    if skipped is None:
        return start_step, None
    sampler.load_state_dict(skipped["data_position"])
    first, last = skipped["skipped_steps"]
    return int(skipped["bad_step"]), (
        f"checkpoint: this run rolled back to step {first - 1} at step {last} ({skipped['reason']}); the data of "
        f"steps {first}-{last} stays skipped, and training goes on at step {last + 1}")
