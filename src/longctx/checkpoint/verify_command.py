"""`longctx checkpoint verify PATH`: which checkpoint was checked, what was checked, each file's
result and a one-line summary, as readable lines (the manifest's dicts are never printed raw).

The checks are manifest.py's (the manifest's own checksum, then each listed file's presence, size
and sha256), all of them: a damaged checkpoint names every damaged file, not only the first.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from ..config.checkpoint_paths import CheckpointError, find_checkpoint, latest_moved_aside, moved_aside_note
from ..config.tokenizer import tokenizer_file, tokenizer_identity
from .manifest import MANIFEST, DamagedManifest, file_problem, read_manifest, unlisted_problems

# the layout's degrees in the order the training line says them (train/report.py describe_run)
_DEGREES = ("dp_replicate", "dp_shard", "head", "ctx")


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def layout_text(layout: dict) -> str:
    """A manifest's layout as the training line says it (train/run_lines.py describe_run): '4 ranks: dp_replicate
    1 x dp_shard 1 x head 2 x ctx 2, head-first (expert 2 folded over them)'. The expert degree is folded over the
    same ranks, not one more factor of them: 'x expert 2' made 2 ranks read as 4. Degrees it does not know are
    added as factors."""
    if not layout:
        return "an unrecorded layout"
    world = layout.get("world", 1)
    if world == 1:
        return "1 process"
    degrees = [k for k in _DEGREES if k in layout] + sorted(
        k for k, v in layout.items()
        if k not in (*_DEGREES, "world", "window", "placement", "expert") and isinstance(v, int))
    text = f"{world} ranks: " + " x ".join(f"{k} {layout[k]}" for k in degrees)
    if layout.get("window"):
        text += f" (window {layout['window']})"
    text += f", {layout['placement']}" if layout.get("placement") else ""
    expert = layout.get("expert", 1)
    return text + (f" (expert {expert} folded over them)" if isinstance(expert, int) and expert > 1 else "")


def model_text(manifest: dict) -> str:
    m = manifest.get("model", {})
    name = m.get("init_from") or m.get("preset") or "a custom [model]"
    parts = [f"{m.get('family', '?')}", f"{m.get('layers', '?')} layers", f"dim {m.get('dim', '?')}"]
    if m.get("moe.experts"):
        parts.append(f"{m['moe.experts']} experts")
    text = f"{name} ({', '.join(parts)}), tokenizer {manifest.get('tokenizer') or 'not recorded'}"
    text += _tokenizer_state(manifest.get("tokenizer"), manifest.get("tokenizer_identity"))
    if manifest.get("trained_positions"):
        text += f", trained on {manifest['trained_positions']:,} positions"
    if manifest.get("draft"):
        draft = manifest["draft"]
        kind = "a Clover draft" if draft.get("kind") == "clover" else f"a GliDe draft of {draft.get('layers')} layers"
        text += (f"; holds {kind} against "
                 f"{draft.get('target', {}).get('path', 'its target')}, not the model")
    return text


def _tokenizer_state(spec: str | None, identity: str | None) -> str:
    """Whether the tokenizer file a manifest names still holds the content it records (config/tokenizer.py
    tokenizer_identity): generate and eval refuse an edited one, and take it moved when given its new path."""
    path = tokenizer_file(spec) if spec and identity and identity.startswith("sha256:") else None
    if path is None:
        return ""
    if not path.is_file():
        return f" (no longer there; its content {identity} is recorded: pass the file where it is now, --tokenizer)"
    if tokenizer_identity(spec) != identity:
        return f" (CHANGED since the run: it no longer holds the content the checkpoint records, {identity})"
    return " (its content as recorded)"


def _when(created: str | None) -> str:
    try:
        return datetime.fromisoformat(created).strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    except (TypeError, ValueError):
        return created or "(time not recorded)"


def _check_fields(path: Path, manifest: dict) -> None:
    """A manifest without a checksum of its own (written before manifests had one, or edited by hand) is
    read as it is: what the lines below need must be there, or it is damaged, not a KeyError."""
    files = manifest.get("files")
    entries_ok = isinstance(files, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("bytes"), int) and "sha256" in e
        for e in files)
    missing = [k for k in ("step", "layout") if k not in manifest] + ([] if entries_ok else ["files"])
    if missing:
        raise DamagedManifest(path, f"lacks or garbles {', '.join(missing)} (a list of files with path, bytes and "
                                    f"sha256), so its files cannot be checked")


def verify_lines(spec: str | Path) -> tuple[list[str], dict[str, str]]:
    """(the lines `longctx checkpoint verify` prints, {path: problem} of the damaged files). A
    checkpoints directory means its latest complete checkpoint; a damaged manifest raises."""
    path = find_checkpoint(spec)
    if path is None:
        raise CheckpointError(f"{spec} holds no complete checkpoint (a step-* directory with {MANIFEST}, or a "
                              f"directory holding them); nothing was checked.{moved_aside_note(spec)}")
    manifest = read_manifest(path)  # (raises when its own checksum does not match)
    _check_fields(path, manifest)
    which = "" if Path(spec).resolve() == path.resolve() else f" (the latest complete one in {spec})"
    moved = latest_moved_aside(spec)  # (`latest` names a step a re-save left moved aside: said, with the way to it)
    lines = [
        f"checkpoint {path}{which}",
        *([f"note: checked {path.name}, the newest complete step, not the one `latest` names: {moved}"]
          if moved else []),
        f"  step {manifest['step']}, written {_when(manifest.get('created'))} by longctx "
        f"{manifest.get('longctx', '?')} (torch {manifest.get('torch', '?')}) under {layout_text(manifest['layout'])}",
        f"  model: {model_text(manifest)}",
        f"checked: {MANIFEST}'s own checksum ("
        + ("matches" if "checksum" in manifest else "none recorded: written before manifests had one")
        + f"), then each of the {len(manifest['files'])} files it lists: present, its size, its sha256",
    ]
    problems, width = {}, max((len(e["path"]) for e in manifest["files"]), default=0)
    for entry in manifest["files"]:
        problem = file_problem(path, entry, checksums=True)
        if problem:
            problems[entry["path"]] = problem
        lines.append(f"  {'DAMAGED' if problem else 'ok':<7}  {entry['path']:<{width}}  "
                     f"{size_text(entry['bytes']):>10}" + (f"  {problem}" if problem else ""))
    unlisted = unlisted_problems(path, manifest)
    for name, problem in unlisted.items():
        problems[name] = problem
        lines.append(f"  {'DAMAGED':<7}  {name:<{width}}  {size_text((path / name).stat().st_size):>10}  {problem}")
    total = sum(e["bytes"] for e in manifest["files"])
    n = len(manifest["files"]) + len(unlisted)
    if problems:
        lines.append(f"DAMAGED: {len(problems)} of {n} files of step {manifest['step']} fail the check; this "
                     f"checkpoint cannot be loaded.")
    else:
        lines.append(f"OK: step {manifest['step']}, all {n} files intact ({size_text(total)}): sizes and sha256 "
                     f"checksums match.")
    return lines, problems


def run(spec: str | Path, say=print) -> int:
    """`longctx checkpoint verify`: print the lines; a damaged checkpoint is an error after them."""
    lines, problems = verify_lines(spec)
    for line in lines:
        say(line)
    if problems:
        files = f"{len(problems)} file{'s' if len(problems) != 1 else ''}"
        raise CheckpointError(f"checkpoint {spec} is damaged ({files}; listed above). Nothing in it "
                              f"can be trusted: resume from another step-* directory.")
    return 0
