"""Where checkpoints are on disk: step directories, the `latest` pointer, what a path names.

Pure path logic (no torch; nothing of longctx but errors). It sits in config/ because the config reads
a checkpoint's [model] through it (`model.init_from = DIR`) before anything else is imported;
checkpoint/ builds on it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..errors import ConfigError, UserError

LATEST = "latest"
MANIFEST = "manifest.json"
MOVED_ASIDE = ".tmp-old-"  # a step directory a re-save of its step moved aside until the new one is published


class CheckpointError(UserError):
    pass


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """step-* directories that hold a manifest, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, if it is complete (else the newest complete one: also for a `latest`
    that names nothing readable, garbled text or bytes that are no UTF-8 at all)."""
    pointer = root / LATEST
    if pointer.is_file():
        try:
            candidate = root / pointer.read_text().strip()
        except UnicodeDecodeError:  # (was a raw traceback from `checkpoint verify` and `resume auto`)
            candidate = None
        if candidate is not None and (candidate / MANIFEST).is_file():
            return candidate
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resume_candidates(root: Path) -> list[Path]:
    """What `--checkpoint.resume auto` tries, in order: the checkpoint `latest` names, then the ones it
    descends from, newest first (`trajectory`). Another attempt's (an explicit resume of an older checkpoint
    leaves the abandoned attempt's in the directory, newer or interleaved) would jump to another trajectory."""
    first = latest_checkpoint(root)
    return [] if first is None else trajectory(root, first)


def auto_checkpoint(root: Path) -> Path | None:
    """The checkpoint `--checkpoint.resume auto` loads, as far as manifests tell: the first of resume_candidates
    whose manifest reads (the checkpoint manager skips one that does not, as damaged, and loads the one before it;
    one whose files are damaged only their checksums tell, when it loads). Else the newest (None: none), whose
    damage preflight and the load say. The config, layout and ranks of a resume are read from this one, where the
    newest's unreadable manifest gave none: the defaults ran with no word on a recorded base (config.toml gone)."""
    candidates = resume_candidates(root)
    return next((p for p in candidates if manifest_or_empty(p)), candidates[0] if candidates else None)


def trajectory(root: Path, newest: Path) -> list[Path]:
    """`newest` and the complete checkpoints of root it descends from, newest first: each manifest names its
    `parent` (the checkpoint the run saved or loaded last before it: name and manifest checksum), followed
    while that directory still holds that very checkpoint (a later attempt may have saved its own of the same
    step). A manifest written before parents were recorded (no `parent` key) is followed by every older
    complete checkpoint, as then; a null parent (a run started afresh) or one gone ends the list."""
    out, at, manifest = [], newest, manifest_or_empty(newest)
    while True:
        out.append(at)
        if "parent" not in manifest:  # (older checkpoints: every complete one before it, newest first)
            return out + [p for p in reversed(complete_checkpoints(root)) if p.name < at.name]
        parent = manifest["parent"]
        if not parent or parent.get("name", "") >= at.name:
            return out
        at = root / parent["name"]
        manifest = manifest_or_empty(at)
        if manifest.get("checksum") != parent.get("checksum"):
            return out


def manifest_or_empty(path: Path) -> dict:
    """A checkpoint's manifest, {} where it cannot be read (none, not JSON, not an object)."""
    try:
        saved = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def resolve_checkpoint(spec: str, root: Path) -> Path | None:
    """'auto' -> the checkpoint auto loads (auto_checkpoint; None if there is none); a path -> that checkpoint
    (a checkpoints directory, or its `latest` pointer file, means its latest)."""
    if spec == "none":
        return None
    if spec == "auto":
        return auto_checkpoint(root)
    path = Path(spec)
    if (path / MANIFEST).is_file():
        return path
    if path.name == LATEST and path.is_file():  # (the pointer itself, e.g. tab-completed: the step it names)
        path = path.parent
    if path.is_dir() and latest_checkpoint(path) is not None:
        return latest_checkpoint(path)
    # (None, Auto, null: a word in another spelling, read as a path that is not there)
    word = {"auto": "auto", "none": "none", "null": "none"}.get(spec.strip().lower())
    hint = f" Did you mean --checkpoint.resume {word} (lowercase)?" if word and not path.exists() else ""
    raise CheckpointError(f"--checkpoint.resume {spec}: no complete checkpoint there (a step-* directory with "
                          f"manifest.json, or a directory holding them).{hint}{moved_aside_note(path)}")


def moved_aside(path) -> Path | None:
    """The complete step directory a re-save of `path`'s step moved aside (MOVED_ASIDE + its name + -<hex>, beside
    it), where `path` itself is not there: what a kill between that move and the publish of the new one leaves,
    and what the next start of its run puts back (checkpoint/retention.py). None: there is none."""
    path = Path(path)
    if not path.name.startswith("step-") or path.exists() or not path.parent.is_dir():
        return None
    for old in sorted(path.parent.glob(f"{MOVED_ASIDE}{path.name}-*")):  # (sorted: the one the sweep puts back)
        if moved_from(old) == path and (old / MANIFEST).is_file():
            return old
    return None


def moved_from(old: Path) -> Path:
    """The step directory a re-save moved aside as `old` (MOVED_ASIDE + its name + -<hex>)."""
    return old.parent / old.name[len(MOVED_ASIDE):].rsplit("-", 1)[0]


def latest_named(root: Path) -> str:
    """What `root`'s `latest` pointer names ('' where there is none, or nothing readable)."""
    try:
        return (root / LATEST).read_text().strip() if (root / LATEST).is_file() else ""
    except (OSError, UnicodeDecodeError):
        return ""


def named_step(spec) -> Path:
    """The step directory `spec` names: itself, or for a checkpoints directory (or its `latest` pointer) the step its
    `latest` names, which resolve_checkpoint would pass over for an older one when that step is moved aside."""
    path = Path(str(spec))
    root = path.parent if path.name == LATEST and path.is_file() else path
    named = latest_named(root) if root.is_dir() else ""
    return root / named if named.startswith("step-") and "/" not in named else path


def latest_moved_aside(spec) -> str:
    """Where `spec` is a checkpoints directory (or its `latest`) whose `latest` names a step a re-save left moved aside
    (moved_aside), so that a read-only command reads the newest complete step instead: which step that is, where it
    is, and how to read it ('' otherwise). `longctx train` puts such a step back and resumes it (train/moved_aside.py);
    verify, export, generate and eval rename nothing (they said nothing of it, or "missing or incomplete")."""
    path = named_step(spec)
    old = moved_aside(path) if path != Path(str(spec)) else None
    if old is None:
        return ""
    return (f"its `{LATEST}` names {path.name}, which a re-save of that step that did not commit left moved aside as "
            f"{old}. To read {path.name} instead, pass {shlex.quote(str(old))} (whole, read where it is), or put it "
            f"back first: --checkpoint.resume auto of its run does, or, with no `longctx train` running on "
            f"{path.parent}: mv {shlex.quote(str(old))} {shlex.quote(str(path))}")


def moved_aside_note(spec) -> str:
    """What a message that found no checkpoint at `spec` adds where its step is whole, moved aside (moved_aside):
    where it is and how to put it back ('' where it is not). A checkpoints directory (or its `latest`): the step its
    `latest` names (named_step), where no other complete step is there to read instead."""
    path = named_step(spec)
    old = moved_aside(path)
    if old is None:
        return ""
    return (f" {path.name} is whole, but moved aside as {old} by a re-save of that step that did not commit (killed "
            f"before it published the new one, or committing now). Resuming it puts it back and trains on from it "
            f"(`longctx train` with --checkpoint.resume {path}, or its run's --checkpoint.resume auto); to only put "
            f"it back, with no `longctx train` running on {path.parent}: mv {shlex.quote(str(old))} "
            f"{shlex.quote(str(path))}")


def find_checkpoint(path) -> Path | None:
    """The complete checkpoint at `path` (a step-* directory, or a checkpoints directory for its
    latest), or None when there is none: for callers that explain the absence in their own words."""
    try:
        return resolve_checkpoint(str(path), Path(path))
    except CheckpointError:
        return None


def check_weights_flag(spec: str, flag: str = "--checkpoint") -> None:
    """The weights a command's `flag` names (generate and eval's --checkpoint, bench decode's --target): hf:DIR a
    directory, else a complete longctx checkpoint (a step-* directory, or a checkpoints directory for its latest)
    whose manifest reads. Refused in the flag's words before the config reads them as model.init_from, whose own
    errors named `model.init_from = ...`, a key the user of these commands never wrote."""
    target = Path(spec.removeprefix("hf:"))
    if target.is_file() and target.suffix == ".gguf":  # (config/hf.py read_hf_config's advice, said before it)
        raise ConfigError(f"{flag} {spec}: {target} is a GGUF file; longctx reads Hugging Face directories. Convert "
                          f"it once with `longctx checkpoint import {target} --out DIR`, then pass {flag} hf:DIR.")
    if spec.startswith("hf:"):
        if not target.is_dir():
            raise ConfigError(f"{flag} {spec}: {target} is not a directory; pass hf:DIR, a local Hugging Face model "
                              f"directory holding config.json and safetensors weights, or a longctx checkpoint "
                              f"(without hf:).")
        return
    found = find_checkpoint(spec)
    if found is None:
        inside = Path(spec) / "checkpoints"  # (a run directory: its checkpoints are one level down)
        hint = f" ({inside} holds some: pass {flag} {inside})" if find_checkpoint(inside) is not None else ""
        raise ConfigError(f"{flag} {spec} holds no complete longctx checkpoint (a step-* directory with {MANIFEST}, "
                          f"or a checkpoints directory holding them){hint}; for Hugging Face weights write hf:DIR."
                          f"{moved_aside_note(spec)}")
    try:
        manifest = json.loads((found / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {spec}: {found / MANIFEST} cannot be read ({e}).") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model"), dict):
        raise ConfigError(f"{flag} {spec}: {found / MANIFEST} records no [model] (it is no longctx checkpoint's "
                          f"manifest, or it is damaged).")


def step_read(spec: str) -> str:
    """What a command that read the weights of `spec` (a longctx checkpoint) says of them: the step read, and
    when `spec` is a checkpoints directory whose `latest` names a step that is missing or incomplete, that the
    newest complete one was read instead. '' for hf:DIR or where there is none."""
    read = read_step(spec)
    if read is None:
        return ""
    step, note = read
    return f" (step {step}{', ' + note if note else ''})"


def read_step(spec: str) -> tuple[int | str, str] | None:
    """(the step of the checkpoint `spec` names, the note step_read adds when `latest` named a missing or
    incomplete one, else ''; one moved aside: latest_moved_aside's, where it is and how to read it); None for
    hf:DIR or where there is none."""
    found = None if spec.startswith("hf:") else find_checkpoint(spec)
    if found is None:
        return None
    # (the step its manifest records: a checkpoint directory of another name, best/ or a copy, is read as well)
    manifest = manifest_or_empty(found)
    recorded = manifest.get("step") if isinstance(manifest, dict) else None
    step = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else \
        found.name.removeprefix("step-").lstrip("0") or "0"
    given = Path(spec)  # (a checkpoints directory, or its `latest` pointer given itself: the same note)
    pointer = given if given.name == LATEST and given.is_file() else given / LATEST
    try:
        named = pointer.read_text().strip() if found != Path(spec) and pointer.is_file() else found.name
    except (OSError, UnicodeDecodeError):
        named = "nothing readable"
    if named == found.name or (named and pointer.parent / named == found):  # (a `latest` of its path too)
        return step, ""
    moved = latest_moved_aside(spec)
    return step, f"the newest complete one: {moved or f'its `{LATEST}` names {named}, which is missing or incomplete'}"
