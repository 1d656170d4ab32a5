"""A resume whose run's config.toml is not found: the config its checkpoint recorded is the base.

`--checkpoint.resume PATH|auto` builds its config on the run's saved config.toml (config/resume.py saved_run_dir).
Checkpoints copied to another machine, or kept in a checkpoint.dir on a shared filesystem after the run directory
(local scratch) was wiped, find none, and the resume ran the defaults plus the command line with no word: another
learning rate, schedule, batch, seq_len, memory policy, data..., only some of it refused late (the data position,
after a store of the default seq_len was built). A checkpoint records the config it trained under (its manifest's
"config": config.toml's text, checkpoint/manifest.py); that record is the base here exactly as config.toml would be
(the same merging, the same changes said and refused), said so.

Keys that name where the old run wrote (OWN_PATHS) are this run's instead: the command line's, else their defaults
in the new run directory (checkpoint.dir: <run_dir>/checkpoints). The old run's places may be on another machine,
unwritable here, or the live directories of a run still going on elsewhere (a checkpoint.dir on a shared filesystem
seen from another node: its `checkpoint.keep` would delete that run's checkpoints); each one replaced is said.
The paths the run reads (data.path, data.tokenizer, model.init_from, draft.target) stay as recorded: they are the
run's data and model, and one missing here is refused by the checks that refuse it for any run. A checkpoint that
records no config (written before they did) still resumes on the defaults plus the command line, now said before
any work. Pure config logic (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checkpoint_paths import manifest_or_empty
from .resume_source import config_text, show

# where a run writes: a resume from a record writes its own (the command line's, or the defaults in its run directory)
OWN_PATHS = (("train", "run_dir"), ("checkpoint", "dir"), ("metrics", "file"))


@dataclass
class RunBase:
    """What a resume continues: `saved`, the config it starts from (read_raw's form), and how it is named."""

    saved: dict
    run_dir: Path  # where `--checkpoint.resume auto` looks (checkpoint_root): the saved run's, or this run's
    named: Path  # the run directory, or (a recorded base) the checkpoint, as messages name what is resumed
    said: str = "its saved config.toml"  # the base, as the resume line says it
    checkpoint: Path | None = None  # a recorded base: the checkpoint whose record it is


def recorded_text(target: Path | None) -> str | None:
    """The config the checkpoint at `target` recorded (config.toml's text), None where it records none."""
    return config_text(manifest_or_empty(target)) if target is not None else None


def looked_in(given: dict, target: Path) -> str:
    """Where saved_run_dir looked for the run's config.toml (config/resume.py), in words."""
    places = []
    if run_dir := given.get("train", {}).get("run_dir"):
        places.append(f"{Path(run_dir) / 'config.toml'} (train.run_dir)")
    places.append(f"{target.resolve()} and the 3 directories above it")
    if named := manifest_or_empty(target).get("run_dir"):
        places.append(f"{named} (the run directory its manifest names)")
    return "looked in " + ", ".join(places)


def recorded_base(saved: dict, given: dict, target: Path) -> RunBase:
    """The RunBase of a resume of `target` on the config it recorded (`saved`, read as config.toml is)."""
    run_dir = Path(given.get("train", {}).get("run_dir") or ".")  # (auto looks in <run_dir>/checkpoints, as given)
    said = f"the config it recorded (the run's config.toml was not found: {looked_in(given, target)})"
    return RunBase(saved, run_dir, target, said, checkpoint=target)


def drop_own_paths(base: dict, given: dict) -> str:
    """Drop from a recorded base the keys naming where the old run wrote (OWN_PATHS), so that this run writes where
    the command line says, else in its own run directory; what is said of it ("": nothing of the old run's left)."""
    old = {(s, k): base.get(s, {}).pop(k, None) for s, k in OWN_PATHS}
    old_run = old[("train", "run_dir")]
    new_run = given.get("train", {}).get("run_dir")
    if not old_run or (new_run and Path(old_run).resolve() == Path(new_run).resolve()):
        return ""
    now = show(new_run) if new_run else "a new runs/<time>-<preset>"
    return (f"train.run_dir {show(old_run)} -> {now}: a resume from a recorded config writes to its own run "
            f"directory (checkpoint.dir and metrics.file: the command line's, else their defaults there), never into "
            f"the old run's places")


def unfound_line(given: dict, target: Path | None, config_file: str | Path | None) -> str | None:
    """What a resume says when neither the run's config.toml nor a recorded config is found (a checkpoint written
    before checkpoints recorded theirs): it runs the defaults plus what is given, which is said before any work,
    with how to give the run's settings. None where `target` is no checkpoint (the resume's own errors say so)."""
    if target is None or not manifest_or_empty(target):
        return None
    given_as = f"{config_file} and the command line" if config_file else "the command line"
    line = (f"resume: {target} with the defaults and {given_as}: the run's config.toml was not found "
            f"({looked_in(given, target)}) and the checkpoint records no config (written before checkpoints did)")
    if config_file:
        return line
    return (f"{line}, so every setting not given here is its default (train.lr, train.global_batch, train.seq_len, "
            f"the memory policy, the data...); to resume under the run's settings, give its config.toml (a copy) "
            f"with --config, or its settings as flags (`longctx train --print-config` lists the keys)")
