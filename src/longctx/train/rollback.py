"""train.on_nonfinite = rollback: going back to the last checkpoint, and what was skipped, kept beside it.

A bad step (non-finite, or a loss spike) found at step B, with the run's newest checkpoint at step
C < B: the run reloads C's weights and optimizer, takes the data position it had after step B, and
goes on at step B + 1. The data of steps C+1..B (the window that led to the bad step) is never
trained on, and steps B+1.. see the data they would have seen. C is never at or after B: after a
`--checkpoint.resume` of an older checkpoint, the newer ones (and `latest`) are the abandoned
attempt's (rollback_candidates). The choice is recorded in `rollbacks.jsonl` in the checkpoint
directory (the run directory's checkpoints/ by default): one JSON line per rollback, written before
training goes on, so that a resume from C, after a crash before the next save, continues at B + 1
with the same data instead of replaying the window.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..checkpoint.manifest import damage_report
from ..config.checkpoint_paths import MANIFEST, trajectory
from ..errors import TrainingError

RECORD = "rollbacks.jsonl"
# rollbacks in a row to one checkpoint (no newer one saved in between) before a bad step stops the run instead:
# every attempt from that checkpoint failed before the next save, so rolling back again only discards more data
REPEAT_LIMIT = 3


def record_rollback(root: Path, bad_step: int, checkpoint_step: int, reason: str, data_position: dict,
                    checksum: str | None = None) -> None:
    """Append one rollback (rank 0 only; flushed to disk before the run goes on). `checksum`: the manifest
    checksum of the checkpoint rolled back to, which names that very checkpoint (a later attempt may save
    its own of the same step)."""
    entry = {"bad_step": bad_step, "rolled_back_to": checkpoint_step, "skipped_steps": [checkpoint_step + 1, bad_step],
             "reason": reason, "data_position": data_position, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             **({"checkpoint": checksum} if checksum else {})}
    root.mkdir(parents=True, exist_ok=True)
    with open(root / RECORD, "a+b") as f:
        size = f.tell()
        f.seek(max(0, size - 1))
        cut = size > 0 and f.read(1) != b"\n"  # a line a crash cut short (one byte, too): this one must not join it
        f.write((("\n" if cut else "") + json.dumps(entry) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def rollback_from(root: Path, checkpoint_step: int, checksum: str | None = None) -> dict | None:
    """The newest rollback to the checkpoint of `checkpoint_step` whose manifest checksum is `checksum` (a
    record written before checksums were, by step alone; None when the run never rolled back to it): a
    resume from that checkpoint continues after its bad step instead. Another attempt's checkpoint of the
    same step, saved after an explicit resume of an older one, is not the one rolled back to."""
    found = rollbacks_to(root, checkpoint_step, checksum)
    return found[-1] if found else None


def rollbacks_to(root: Path, checkpoint_step: int, checksum: str | None = None) -> list[dict]:
    """Every rollback to that checkpoint (rollback_from), oldest first: all made after it was saved, in
    the one trajectory that goes on from it (a resume from it skips to after the newest one's bad step)."""
    path = root / RECORD
    if not checkpoint_step or not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut by a crash while it was written: that rollback did not go on
            continue
        if entry.get("rolled_back_to") == checkpoint_step and entry.get("checkpoint", checksum) == checksum:
            found.append(entry)
    return found


def skip_rolled_back_window(root: Path, start_step: int, sampler, checksum: str | None = None,
                            saved_in: Path | None = None) -> tuple[int, str | None, int]:
    """A resume from a checkpoint the run once rolled back to (the one of manifest checksum `checksum`)
    continues after the bad step, with the data it had then, instead of replaying the skipped window:
    (the step to start after, what to log, how many rollbacks went to it: the run's count, which the
    checkpoint saved before them, goes on past them); unchanged (and 0) when the checkpoint was no
    rollback's. `saved_in`: the directory the checkpoint was loaded from, whose record is read too when it
    is not `root` (a resume of another run directory's checkpoint; this run's own record, written since, first)."""
    found = rollbacks_to(root, start_step, checksum)
    if not found and saved_in is not None and saved_in.resolve() != root.resolve():
        found = rollbacks_to(saved_in, start_step, checksum)
    if not found:
        return start_step, None, 0
    skipped = found[-1]
    sampler.load_state_dict(skipped["data_position"])
    first, last = skipped["skipped_steps"]
    return int(skipped["bad_step"]), (
        f"checkpoint: this run rolled back to step {first - 1} at step {last} ({skipped['reason']}); the data of "
        f"steps {first}-{last} stays skipped, and training goes on at step {last + 1}"), len(found)


def resume_past_rollback(ckpt, start_step: int, sampler, log) -> tuple[int, int]:
    """(the step a resume starts after, the rollbacks to be counted beyond the checkpoint's own count): past the
    skipped window when the loaded checkpoint is one the run rolled back to (skip_rolled_back_window; the spike
    check's window is the checkpoint's, as after the rollback), else (`start_step`, 0)."""
    if ckpt is None or not start_step or not ckpt.resumed_from:
        return start_step, 0
    path, manifest = ckpt.resumed_from  # (maybe another run directory's checkpoint: its record read too)
    start_step, note, rollbacks = skip_rolled_back_window(ckpt.root, start_step, sampler, manifest.get("checksum"),
                                                          path.parent)
    if note:
        log(note)
    return start_step, rollbacks


class BadStep(Exception):
    """A step whose update was not applied, read back under train.on_nonfinite = rollback."""

    def __init__(self, step: int, reason: str, position: dict):
        super().__init__(reason)
        self.step, self.reason, self.position = step, reason, position


def _named_step(path: Path) -> int | None:
    """The step of a step-NNNNNNNN directory, from its name (read before anything in it is verified)."""
    digits = path.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


def rollback_candidates(ckpt, bad_step: int) -> list[Path]:
    """The complete checkpoints a rollback at `bad_step` may go back to, best first (the same list on
    every rank).

    Only checkpoints before the bad step: one at or after it is another trajectory's (an explicit
    resume of an older checkpoint leaves the newer ones, and `latest`, to the attempt it abandoned).
    First this run's own newest: the one it loaded last (its resume, or its last rollback) or the one it
    committed last (`ckpt.parent`; not the one `latest` names: a save that failed under on_save_error = warn
    leaves it at another attempt's or another run's). Then the ones that one descends from, in its own
    directory (its trajectory: another attempt's, newer or interleaved, and another run's in a checkpoint.dir
    it shares are not this run's), newest first, for when this run's own is damaged. A run with neither has
    none (a fresh run took the newest in its directory: another run's weights, and a rollback record that a
    resume of that run then obeyed)."""
    own = [] if ckpt.resumed_from is None else [(int(ckpt.resumed_from[1]["step"]), ckpt.resumed_from[0])]
    if ckpt.parent is not None:  # (the checkpoint it committed or loaded last in its own directory)
        committed = ckpt.root / ckpt.parent["name"]
        own.append((_named_step(committed), committed))
    own = [(step, path) for step, path in own if step is not None and step < bad_step]
    if not own:
        return []
    limit = 1 + max(step for step, _ in own)
    newest = max(own, key=lambda c: c[0])[1]
    # (in its own directory: one loaded from elsewhere descends from that directory's, not from checkpoint.dir's,
    # which may hold another run's)
    others = [(step, p) for p in trajectory(newest.parent, newest)
              if (step := _named_step(p)) is not None and step < limit]
    ordered = []
    for _, path in sorted([*own, *others], key=lambda c: -c[0]):  # (stable: this run's own first on a tie)
        if (path / MANIFEST).is_file() and path.resolve() not in {p.resolve() for p in ordered}:
            ordered.append(path)  # (a checkpoint loaded once may have been pruned since)
    return ordered


def check_repeats(bad: BadStep, path: Path, manifest: dict, repeats: dict) -> None:
    """Count a rollback to the checkpoint at `path` in `repeats` (the run's: {"checkpoint", "bad_steps"} of
    its last rollbacks in a row to one checkpoint); a TrainingError once REPEAT_LIMIT of them went there."""
    key = [path.name, manifest.get("checksum")]
    if repeats.get("checkpoint") != key:
        repeats.update(checkpoint=key, bad_steps=[])
    steps = repeats["bad_steps"]
    if len(steps) >= REPEAT_LIMIT:
        raise TrainingError(
            f"{bad.reason} at step {bad.step}, and train.on_nonfinite = rollback, but the run already rolled back "
            f"to {path.name} {len(steps)} times in a row (at steps {', '.join(map(str, steps))}) without reaching "
            f"a save after it: training from that checkpoint keeps failing, and rolling back again would only "
            f"discard more data. The run stops. Lower train.lr or set train.grad_clip, or resume from an earlier "
            f"checkpoint (--checkpoint.resume PATH).")
    steps.append(bad.step)


def roll_back(bad: BadStep, ckpt, model, optimizer, sampler, is_main: bool, repeats: dict | None = None,
              last_step: int | None = None) -> str:
    """Reload this run's newest intact checkpoint before the bad step (rollback_candidates), take the
    data position after the bad step and record the skipped window; returns what to log. `repeats`: the
    run's count of rollbacks in a row to one checkpoint (check_repeats); `last_step`: train.steps (a bad
    last step leaves no step to go on at: the run ends with the checkpoint's weights)."""
    found, damaged = None, {}
    for path in rollback_candidates(ckpt, bad.step):
        manifest, problems = ckpt.find_damage(path)  # collective: every rank checks the same paths in order
        if not problems:
            found = path, manifest
            break
        damaged[path.name] = damage_report(problems)
        ckpt.log(f"checkpoint: {path} is damaged ({damaged[path.name]}); not rolling back to it, trying the "
                 f"previous checkpoint")
    if found is None:
        why = (f"no checkpoint before it is intact ({'; '.join(f'{n}: {r}' for n, r in damaged.items())})"
               if damaged else "no checkpoint was saved before it")
        raise TrainingError(
            f"{bad.reason} at step {bad.step}, and train.on_nonfinite = rollback, but {why}, so there is nothing "
            f"to roll back to; the run stops. Lower checkpoint.interval so that a checkpoint precedes the first bad "
            f"step, or use train.on_nonfinite = skip.")
    path, manifest = found
    check_repeats(bad, path, manifest, {} if repeats is None else repeats)
    state = ckpt.load(path, model, optimizer, manifest)  # (a progress phase counting its MB, as a resume's)
    back_to = int(state["step"])
    if is_main:
        try:
            record_rollback(ckpt.root, bad.step, back_to, bad.reason, bad.position, manifest.get("checksum"))
        except OSError as e:  # (a full disk: said as what it is, not a traceback; the run must not go on unrecorded)
            raise TrainingError(
                f"{bad.reason} at step {bad.step}: the run rolled back to {path.name}, but could not record it in "
                f"{ckpt.root / RECORD} ({e.strerror or e}); the run stops, since a resume from {path.name} without "
                f"that record would train on the skipped window again. Free space there and resume with "
                f"--checkpoint.resume auto: it continues from {path.name} and rolls back again at the bad step."
            ) from e
    sampler.load_state_dict(bad.position)
    return (f"step {bad.step}: {bad.reason}: rolled back to the checkpoint of step {back_to} ({path.name}); "
            f"the data of steps {back_to + 1}-{bad.step} is skipped (recorded in {ckpt.root / RECORD}), "
            + (f"and training goes on at step {bad.step + 1}" if last_step is None or bad.step < last_step else
               f"and step {bad.step} was the run's last (train.steps): the run ends with the weights of step "
               f"{back_to} ({path}), with no metrics line, evaluation or save of step {bad.step}"))
