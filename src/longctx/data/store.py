"""The packed-data store: token samples as memory-mapped numpy arrays, an index, a manifest.

A sample is one packed training sequence of `seq_len` tokens. Layout of a store directory:

    manifest.json                 written last: a store is complete exactly when it exists
    part-00000/                   one part per build or append; never rewritten
      train.tokens.npy            uint16/uint32 [samples, seq_len], padded with the pad token
      train.segments.npy          int64 [segments, 5]: sample, offset, length, doc, start
      train.samples.npy           int64 [samples + 1]: each sample's first segment (CSR pointer)
      eval.*                      the same for the eval split (documents held out by name hash)
      docs.jsonl                  per document (doc = its line number + the part's first doc id):
                                  name, tokens (EOS included), split
      hashes.npy                  uint64 exact-duplicate hash per document (dedup across appends)
      minhash.npy                 uint64 [docs, 128] MinHash signatures (with --dedup minhash)

A segment `(sample, offset, length, doc, start)` says that tokens `[start, start + length)` of
document `doc` lie at `[offset, offset + length)` of the sample; a sample's segments are
contiguous from offset 0, and the rest of the sample is padding.

Stores written before format version 2 name some manifest keys and the pointer file differently
(`LEGACY_KEYS`, `LEGACY_POINTER`); `read_manifest` renames the keys in memory and `load_split`
reads either pointer file, so such stores still load and take appends.

Crash safety: a part is written under `.tmp-part-*` and renamed into place; the manifest is
written to a temporary file and renamed over `manifest.json` last. An interrupted build or
append leaves either no manifest (the store does not look complete) or the previous manifest,
which does not list the unfinished part (the next append removes it).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError

MANIFEST = "manifest.json"
FORMAT = "longctx-store"
VERSION = 2
READABLE_VERSIONS = (1, 2)
SPLITS = ("train", "eval")
# segment columns in the store
S_SAMPLE, S_OFFSET, S_LENGTH, S_DOC, S_START = range(5)
POINTER = "samples"  # {split}.samples.npy

# Version 1 (before issue 19 made "sample" the one name of a packed sequence and "seq_len" the
# one name of its length) called a sample a "window" and seq_len "context". Old name -> new name,
# for manifest keys at any depth; and the old pointer file name {split}.windows.npy.
LEGACY_KEYS = {
    "context": "seq_len",
    "train_windows": "train_samples",
    "eval_windows": "eval_samples",
    "windows": "samples",
    "docs_per_window": "docs_per_sample",
    "multi_doc_windows": "multi_doc_samples",
    "longer_than_context": "longer_than_seq_len",
}
LEGACY_POINTER = "windows"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


@dataclass
class SplitArrays:
    tokens: np.ndarray    # [samples, seq_len]
    segments: np.ndarray  # [segments, 5]
    pointer: np.ndarray   # [samples + 1]: each sample's first segment


def _fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_part_dir(root: Path, index: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-part-{index:05d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish_part(tmp: Path, root: Path, index: int) -> str:
    name = f"part-{index:05d}"
    final = root / name
    if final.exists():  # left by an append that died before its manifest: not part of the store
        shutil.rmtree(final)
    # durable before it is published: after a power loss the manifest must never name a part whose
    # files did not reach the disk
    for f in tmp.iterdir():
        _fsync_path(f)
    _fsync_path(tmp)
    os.replace(tmp, final)
    _fsync_path(root)
    return name


def write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    _fsync_path(tmp)
    os.replace(tmp, root / MANIFEST)
    _fsync_path(root)


def read_manifest(root: str | Path) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        hint = (" It holds an unfinished build (no manifest.json is written until a build completes); "
                "run `longctx data build` again." if root.is_dir() and any(root.iterdir()) else "")
        raise DataError(
            f"'{root}' is not a longctx data store: {path} does not exist.{hint} Build one with "
            f"`longctx data build --input PATH --seq-len N --out {root}`."
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); rebuild the store with `longctx data build`.") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise DataError(f"{path} is not a longctx store manifest of a version this longctx reads "
                        f"({' or '.join(map(str, READABLE_VERSIONS))}); rebuild it with this version's "
                        f"`longctx data build`.")
    return _renamed_legacy_keys(manifest) if manifest["version"] < VERSION else manifest


def _renamed_legacy_keys(obj):
    """A version-1 manifest with today's key names (`LEGACY_KEYS`), in memory; `version` stays 1."""
    if isinstance(obj, dict):
        return {LEGACY_KEYS.get(k, k): _renamed_legacy_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_renamed_legacy_keys(v) for v in obj]
    return obj


def remove_stale(root: Path, manifest: dict | None) -> None:
    """Temporary and unlisted parts left by interrupted builds or appends."""
    listed = {p["dir"] for p in manifest["parts"]} if manifest else set()
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith(".tmp-part-") or (p.name.startswith("part-") and p.name not in listed):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{MANIFEST}.tmp-"):
            p.unlink(missing_ok=True)


def load_split(root: Path, part: dict, split: str) -> SplitArrays | None:
    if part["splits"][split]["samples"] == 0:
        return None
    d = root / part["dir"]
    pointer = d / f"{split}.{POINTER}.npy"
    if not pointer.is_file() and (d / f"{split}.{LEGACY_POINTER}.npy").is_file():  # a version-1 part
        pointer = d / f"{split}.{LEGACY_POINTER}.npy"
    try:
        return SplitArrays(
            np.load(d / f"{split}.tokens.npy", mmap_mode="r"),
            np.load(d / f"{split}.segments.npy"),
            np.load(pointer),
        )
    except (OSError, ValueError) as e:
        raise DataError(f"the store '{root}' is damaged: {d}/{split}.* cannot be read ({e}); rebuild it.") from None


def load_part_docs(root: Path, part: dict) -> tuple[np.ndarray, np.ndarray | None]:
    d = root / part["dir"]
    hashes = np.load(d / "hashes.npy")
    sigs = np.load(d / "minhash.npy") if (d / "minhash.npy").is_file() else None
    return hashes, sigs
