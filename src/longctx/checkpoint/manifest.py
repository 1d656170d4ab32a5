"""The manifest of a complete checkpoint: what it holds, how it was written, and its files' checksums.

A checkpoint directory is complete exactly when its manifest.json exists: the manifest is written
last, after every file, and the directory is then published by an atomic rename.

Checksums are computed where the bytes were written: each rank hashes its own files (`owner_rank`)
and leaves the result in `hashes-rank{r}.json`; the rank that commits only merges those parts into
the manifest. The manifest carries a checksum of its own, so that a damaged manifest is not
trusted either.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..config.checkpoint_paths import (  # (re-exported: the checkpoint package's error and file name)
    MANIFEST,
    CheckpointError,
)
from ..config.weight_shapes import shape_differences
from ..durable import fsync_path, write_text_durably
from ..job import watchdog
from .identity import same_weights

FORMAT = "longctx-checkpoint/1"

HASHES_PREFIX = "hashes-rank"  # per-rank checksum parts, merged into the manifest and then removed
CHECKSUM_MISMATCH = "does not match its sha256 checksum"
# files one rank writes: DCP's shards `__{rank}_{n}.distcp` (and its rank-local `__{rank}.metadata`
# when it saves without coordination), the manager's `rng-rank{rank}.pt`
_RANK_FILE = re.compile(r"^(?:__|rng-rank|local-rank)(\d+)[_.]")


class DamagedManifest(CheckpointError):
    """manifest.json is there but cannot be trusted; `problem` says why."""

    def __init__(self, directory: Path, problem: str):
        super().__init__(f"checkpoint {directory} is damaged: {MANIFEST} {problem}. Nothing was loaded.")
        self.problem = problem


def sha256(path: Path, chunk: int = 1 << 22, progress=None) -> str:
    """The file's checksum; its MB read counted in `progress` (a progress.Phase), if given, block by block."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)  # hashlib releases the GIL on blocks this large: other threads keep running
            watchdog.tick()  # (reading a save back to hash it is progress: a rank waiting on it is not hung)
            if progress is not None:
                progress.update(len(block) / 1e6)
    return h.hexdigest()


def owner_rank(name: str) -> int:
    """The rank that wrote the checkpoint file `name`; the files written once for the job
    (.metadata, trainer_state.json) are rank 0's."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m else 0


def rank_bytes(directory: Path, rank: int) -> int:
    """The bytes of the checkpoint files `rank` has written into `directory` so far (the watchdog's measure of a
    save's progress: job/watchdog.py watch_writes); a directory gone (published or removed) raises OSError."""
    with os.scandir(directory) as entries:
        return sum(e.stat().st_size for e in entries if e.is_file() and owner_rank(e.name) == rank)


def checkpoint_files(directory: Path) -> list[str]:
    """Paths (relative, sorted) of the files a manifest lists: all but the manifest and the hash parts."""
    return sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(HASHES_PREFIX))


def hash_files(directory: Path, paths, sync: bool = False) -> dict[str, dict]:
    """{path: {"bytes", "sha256"}} of the given files of `directory`; `sync`: each file is also flushed to
    stable storage (the rank that wrote it does so before the checkpoint is published: durable.py)."""
    hashes = {}
    for rel in paths:
        hashes[rel] = {"bytes": (directory / rel).stat().st_size, "sha256": sha256(directory / rel)}
        if sync:
            fsync_path(directory / rel)
    return hashes


def write_hashes_part(directory: Path, rank: int, hashes: dict[str, dict]) -> None:
    # Not fsynced: the part only has to be visible to the committing rank (after a barrier), not to
    # survive a crash; what must survive is the manifest it is merged into.
    (directory / f"{HASHES_PREFIX}{rank}.json").write_text(json.dumps(hashes))


def collect_hashes_parts(directory: Path, ranks) -> dict[str, dict]:
    """Merge (and remove) the checksum parts of `ranks`; each must have written its part."""
    merged = {}
    for rank in ranks:
        part = directory / f"{HASHES_PREFIX}{rank}.json"
        if not part.is_file():
            raise CheckpointError(f"rank {rank} left no checksums in {directory}; the save is incomplete.")
        merged.update(json.loads(part.read_text()))
        part.unlink()
    return merged


def write_manifest(directory: Path, *, step: int, layout: dict, model: dict,
                   hashes: dict[str, dict] | None = None, tokenizer: str | None = None,
                   tokenizer_identity: str | None = None, draft: dict | None = None, trained_positions: int = 0,
                   run_dir: str | None = None, holdout_tokens: int = 0, text_prefix: list[int] | None = None,
                   parent: dict | None = None, config: str | None = None) -> dict:
    """Write manifest.json (last, atomically). `hashes` are the ranks' checksums of their files; any file
    on disk they do not cover (all of them when None) is hashed here, so the manifest lists every file.
    `tokenizer_identity`: the run's tokenizer's content (config/tokenizer.py tokenizer_identity, as data stores
    record it), which names it wherever its file is (and tells an edited one); None = left out.
    `draft`: a GliDe draft's record (train/glide.py: its target, layers, block, loss); the checkpoint
    then holds the draft's weights only, and `model` is its target's config. `trained_positions`: the
    positions the weights have trained on (config/positions.py; 0 = not known, left out). `run_dir`: the run
    directory (absolute) whose config.toml a resume continues (config/resume.py; None: left out).
    `holdout_tokens`: the eval-split grid of the store the run trained on when it built it from data.corpus
    (data/default_store.py, whose trained_grid reads it; 0 = left out). `text_prefix`: the special tokens
    its documents began with (e.g. BOS: data/builder/tokenize.py), which `longctx generate` and `longctx
    eval` put before a prompt (config/tokenizer.py model_text_prefix; none = left out). `parent`: the
    checkpoint the run saved or loaded last before this one ({"name", "checksum"}; None: it started afresh),
    which keep, resume auto and rollbacks follow (config/checkpoint_paths.py trajectory). `config`: the TOML text
    of the config the weights trained under (the run's config.toml as the run wrote it), against which a resume of
    this checkpoint says and refuses its changes though a later resume rewrote config.toml (config/resume.py; None:
    left out)."""
    hashes = dict(hashes or {})
    missing = [rel for rel in checkpoint_files(directory) if rel not in hashes]
    hashes.update(hash_files(directory, missing))
    manifest = {
        "format": FORMAT,
        "step": step,
        "layout": layout,
        "model": model,
        "tokenizer": tokenizer,
        **({"tokenizer_identity": tokenizer_identity} if tokenizer_identity else {}),
        **({"trained_positions": int(trained_positions)} if trained_positions else {}),
        **({"draft": draft} if draft else {}),
        **({"run_dir": run_dir} if run_dir else {}),
        **({"holdout_tokens": int(holdout_tokens)} if holdout_tokens else {}),
        **({"text_prefix": [int(t) for t in text_prefix]} if text_prefix else {}),
        "parent": parent,
        **({"config": config} if config else {}),
        "files": [{"path": rel, **hashes[rel]} for rel in sorted(hashes)],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "longctx": __version__,
        "torch": torch.__version__,
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    write_text_durably(directory / MANIFEST, json.dumps(manifest, indent=2))  # last: it makes the directory complete
    return manifest


# every top-level key write_manifest writes: a manifest without its checksum holding another key is damaged
MANIFEST_KEYS = frozenset({"format", "step", "layout", "model", "tokenizer", "tokenizer_identity", "trained_positions",
                           "draft", "run_dir", "holdout_tokens", "text_prefix", "parent", "config", "files", "created",
                           "longctx", "torch", "checksum"})


def _manifest_checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete longctx checkpoint (no {MANIFEST}); it may be a save that was "
            f"interrupted. Use the checkpoint that `latest` names, or another step-* directory."
        )
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedManifest(directory, f"is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise DamagedManifest(directory, "is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this longctx reads {FORMAT!r}.")
    # manifests written before the manifest had a checksum of its own are read as they are
    if "checksum" in manifest and manifest["checksum"] != _manifest_checksum(manifest):
        raise DamagedManifest(directory, CHECKSUM_MISMATCH)
    if "checksum" not in manifest:  # (one flipped bit in the key's name read as "written before checksums")
        unknown = sorted(k for k in manifest if k not in MANIFEST_KEYS)
        if unknown:
            raise DamagedManifest(directory, f"has no checksum of its own and holds {', '.join(map(repr, unknown))}, "
                                             f"which longctx never writes (a damaged 'checksum' key?)")
    return manifest


def file_problem(directory: Path, entry: dict, checksums: bool = True, progress=None) -> str | None:
    """What is wrong with one file the manifest lists (None when it is intact); `progress`: as sha256's."""
    p = Path(directory) / entry["path"]
    if not p.is_file():
        return "is missing"
    size = p.stat().st_size
    if size != entry["bytes"]:
        return f"has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
    if checksums and sha256(p, progress=progress) != entry["sha256"]:
        return CHECKSUM_MISMATCH
    return None


# the files a load reads (DCP's metadata and shards, each rank's RNG state, the trainer state): one on disk that
# the manifest does not list is read unchecked (a manifest edited by hand, or one written before manifests had a
# checksum of their own, with an entry removed: verify said "all files intact" and the export wrote its weights).
# Only the names those are written under, at the top of the directory (all a load opens there): a sub-folder's
# files, macOS's '._' copies of extended attributes ('.___0_0.distcp' on exFAT or SMB) or a Finder duplicate
# ('__0_0 copy.distcp') are read by nothing, and a checkpoint holding one was refused as damaged.
_LOADED_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp|(?:rng|local)-rank\d+\.pt|trainer_state\.json)$")
UNLISTED = f"is not listed in {MANIFEST}, so nothing checks it, and loading reads it (a manifest edited by hand?)"


def unlisted_problems(directory: Path, manifest: dict) -> dict[str, str]:
    """{path: UNLISTED} for each file a load reads that lies in `directory` and the manifest does not list."""
    listed = {e["path"] for e in manifest["files"]}
    return {name: UNLISTED for name in checkpoint_files(directory)
            if name not in listed and len(Path(name).parts) == 1 and _LOADED_FILE.match(name)}


def verification_shares(entries: list[dict], world: int) -> list[int]:
    """The rank that checks each manifest entry: largest files first, each to the rank with the fewest
    bytes so far (ties: the lowest rank), so the ranks hash about equal amounts whatever world size
    wrote the checkpoint. Deterministic, so every rank computes the same shares without talking."""
    owner, load = [0] * len(entries), [0] * world
    for i in sorted(range(len(entries)), key=lambda i: (-entries[i]["bytes"], entries[i]["path"])):
        owner[i] = min(range(world), key=lambda r: (load[r], r))
        load[owner[i]] += entries[i]["bytes"]
    return owner


def damage_report(problems: dict[str, str]) -> str:
    """One line naming each damaged file and what is wrong with it."""
    return "; ".join(f"{path} {problem}" for path, problem in problems.items())


def verify(directory: Path, checksums: bool = True, progress=None) -> dict:
    """Check every listed file exists with its size (and checksum); return the manifest. `progress` (a
    progress.Phase), if given, counts the MB checksummed of the files' total."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if progress is not None and checksums:
        progress.expect(sum(e["bytes"] for e in manifest["files"]) / 1e6, "MB")
    problems = {e["path"]: p for e in manifest["files"] if (p := file_problem(directory, e, checksums, progress))}
    problems.update(unlisted_problems(directory, manifest))
    if problems:
        raise CheckpointError(f"checkpoint {directory} is damaged: {damage_report(problems)}. "
                              f"Nothing was loaded.")
    return manifest


def check_model_matches(manifest: dict, model_cfg: dict, where: Path) -> None:
    saved = manifest["model"]
    diff = shape_differences(saved, model_cfg)
    if diff:
        details = ", ".join(f"{k} {a} in the checkpoint vs {b} configured" for k, (a, b) in diff.items())
        same = (f"--model.init_from {saved['init_from']}" if saved.get("init_from")
                else f"--model.preset {saved.get('preset')}")
        raise CheckpointError(
            f"checkpoint {where} was written for another model ({details}). Configure the same model shape "
            f"(e.g. {same}) or start without --checkpoint.resume. Nothing was loaded."
        )


def check_weights_fit(directory: Path, model_keys, fix: str = "start without --checkpoint.resume") -> None:
    """Refuse a checkpoint whose model holds tensors that the configured model has no place for: DCP reads only
    the keys it is asked for, so a model with fewer parameters than the checkpoint's (a field the model check
    does not know, a caller without a model config) would take part of it without a word. `fix`: the way
    out other than configuring the saved model, for the error."""
    import torch.distributed.checkpoint as dcp  # (only on a load: a manifest reader needs no DCP)

    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    extra = sorted(k.removeprefix("model.") for k in saved if k.startswith("model.")
                   and k.removeprefix("model.") not in model_keys)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise CheckpointError(
            f"checkpoint {directory} holds model tensors that the configured model lacks ({shown}): it was written "
            f"for another model. Configure the model it was saved with, or {fix}. "
            f"Nothing was loaded.")


def check_draft_matches(manifest: dict, draft_layers: int | None, where: Path, kind: str = "glide",
                        vocab: int = 0, target_identity: str | None = None) -> None:
    """A run resumes only a checkpoint of its own kind: a draft run (draft_layers: its draft.layers; `kind`
    and `vocab`: its draft.kind and draft.vocab) a draft's checkpoint of that kind, layers and vocabulary,
    trained against the same target weights (`target_identity`: checkpoint/identity.py, of this run's
    draft.target; a `<run>/checkpoints` target names its latest step, which moves on when that run does),
    a model run (None) a model's."""
    saved = manifest.get("draft")
    if saved and draft_layers is None:
        raise CheckpointError(
            f"checkpoint {where} holds a {saved.get('kind', 'glide')} draft (trained against "
            f"{saved.get('target', {}).get('path')!r}), not a model: a run without draft.target cannot resume it. "
            f"Resume it with its own config (--draft.target), or start without --checkpoint.resume. Nothing was "
            f"loaded.")
    if draft_layers is not None and not saved:
        raise CheckpointError(
            f"checkpoint {where} holds a model, not a draft: a draft run (draft.target set) resumes only a "
            f"draft's checkpoint. Name one of this draft run's checkpoints, or start without --checkpoint.resume. "
            f"Nothing was loaded.")
    if not saved:
        return
    theirs_target = saved.get("target") or {}
    recorded = theirs_target.get("identity")
    if target_identity and recorded and not same_weights(recorded, target_identity):
        raise CheckpointError(
            f"checkpoint {where} holds a draft trained against the target weights {theirs_target['identity']} "
            f"({theirs_target.get('path')!r}), but this run's draft.target holds other weights ({target_identity}): "
            f"resuming would go on distilling another target. Point --draft.target at the checkpoint the draft was "
            f"trained against (a step-N directory, not a run's checkpoints directory whose latest moves on; "
            f"`longctx train` takes that change with --checkpoint.allow_changes true), or start a new draft run. "
            f"Nothing was loaded.")
    mine = {"kind": kind, "layers": draft_layers, "vocab": vocab}
    theirs = {"kind": saved.get("kind", "glide"), "layers": saved.get("layers"), "vocab": saved.get("vocab", 0)}
    differ = [k for k in mine if mine[k] != theirs[k]]
    if differ:
        said = ", ".join(f"draft.{k} {theirs[k]!r} (this run: {mine[k]!r})" for k in differ)
        flags = " ".join(f"--draft.{k} {theirs[k]}" for k in differ)
        raise CheckpointError(
            f"checkpoint {where} holds another draft: {said}; set {flags} or start without "
            f"--checkpoint.resume. Nothing was loaded.")
