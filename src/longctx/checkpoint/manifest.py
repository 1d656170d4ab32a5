"""The manifest of a complete checkpoint: what it holds, how it was written, and its files' checksums.

A checkpoint directory is complete exactly when its manifest.json exists: the manifest is written
last, after every file, and the directory is then published by an atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..errors import UserError

FORMAT = "longctx-checkpoint/1"
MANIFEST = "manifest.json"
# model fields that decide tensor shapes: a checkpoint only loads into a model that agrees on them
SHAPE_FIELDS = ("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
# parameters that exist only in some families; manifests older than them had none
OPTIONAL_PARAM_FIELDS = ("qkv_bias", "out_bias", "qk_norm")


class CheckpointError(UserError):
    pass


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, *, step: int, layout: dict, model: dict) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": FORMAT,
        "step": step,
        "layout": layout,
        "model": model,
        "files": [{"path": str(p.relative_to(directory)), "bytes": p.stat().st_size, "sha256": sha256(p)}
                  for p in files],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "longctx": __version__,
        "torch": torch.__version__,
    }
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete longctx checkpoint (no {MANIFEST}); it may be a save that was "
            f"interrupted. Use the checkpoint that `latest` names, or another step-* directory."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this longctx reads {FORMAT!r}.")
    return manifest


def verify(directory: Path, checksums: bool = True) -> dict:
    """Check every listed file exists with its size (and checksum); return the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems = []
    for entry in manifest["files"]:
        p = directory / entry["path"]
        if not p.is_file():
            problems.append(f"{entry['path']} is missing")
        elif p.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['path']} has {p.stat().st_size} bytes, the manifest says {entry['bytes']} "
                            f"(truncated or overwritten)")
        elif checksums and sha256(p) != entry["sha256"]:
            problems.append(f"{entry['path']} does not match its sha256 checksum")
    if problems:
        raise CheckpointError(f"checkpoint {directory} is damaged: {'; '.join(problems)}. Nothing was loaded.")
    return manifest


def check_model_matches(manifest: dict, model_cfg: dict, where: Path) -> None:
    saved = manifest["model"]
    diff = {k: (saved.get(k), model_cfg.get(k)) for k in SHAPE_FIELDS if saved.get(k) != model_cfg.get(k)}
    diff.update({k: (saved.get(k, False), model_cfg.get(k, False)) for k in OPTIONAL_PARAM_FIELDS
                 if saved.get(k, False) != model_cfg.get(k, False)})
    if saved.get("head_dim", 0) or model_cfg.get("head_dim", 0):
        def hd(c):
            return c.get("head_dim") or c["dim"] // c["heads"]

        if hd(saved) != hd(model_cfg):
            diff["head_dim"] = (hd(saved), hd(model_cfg))
    if diff:
        details = ", ".join(f"{k} {a} in the checkpoint vs {b} configured" for k, (a, b) in diff.items())
        same = (f"--model.init_from {saved['init_from']}" if saved.get("init_from")
                else f"--model.preset {saved.get('preset')}")
        raise CheckpointError(
            f"checkpoint {where} was written for another model ({details}). Configure the same model shape "
            f"(e.g. {same}) or start without --checkpoint.resume. Nothing was loaded."
        )
