"""train.on_nonfinite = rollback: going back to the last checkpoint, and what was skipped, kept beside it.

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

from ..errors import TrainingError

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


class BadStep(Exception):
    """A step whose update was not applied, read back under train.on_nonfinite = rollback."""

    def __init__(self, step: int, reason: str, position: dict):
        super().__init__(reason)
        self.step, self.reason, self.position = step, reason, position


def roll_back(bad: BadStep, ckpt, model, optimizer, sampler, is_main: bool) -> str:
    """Reload the newest checkpoint (before the bad step: every save reads the steps before it),
    take the data position after the bad step and record the skipped window; returns what to log."""
    found = ckpt.resume_point("auto")
    if found is None:
        raise TrainingError(
            f"{bad.reason} at step {bad.step}, and train.on_nonfinite = rollback, but no checkpoint was saved "
            f"before it, so there is nothing to roll back to; the run stops. Lower checkpoint.interval so that "
            f"a checkpoint precedes the first bad step, or use train.on_nonfinite = skip.")
    path, manifest = found
    state = ckpt.load(path, model, optimizer, manifest)
    back_to = int(state["step"])
    if is_main:
        record_rollback(ckpt.root, bad.step, back_to, bad.reason, bad.position)
    sampler.load_state_dict(bad.position)
    return (f"step {bad.step}: {bad.reason}: rolled back to the checkpoint of step {back_to} ({path.name}); "
            f"the data of steps {back_to + 1}-{bad.step} is skipped (recorded in {ckpt.root / RECORD}), "
            f"and training goes on at step {bad.step + 1}")
