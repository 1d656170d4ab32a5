"""Which weights a path holds, as a short identity: what a GliDe draft records of the target it was
trained against, so that a draft is never used beside another target of the same shape (a later
step of the same run, a fine-tune, another seed: each would drop its acceptance without a word).

- A longctx checkpoint: sha256 over its manifest's file list (each file's path and sha256, which
  the manifest already holds: nothing is read but the manifest). A copy of the checkpoint has the
  same identity; another step of the same run does not.
- hf:DIR: a fingerprint, not a full hash (a full one would read every byte of a many-GB model at
  every `generate`): sha256 over config.json and, per safetensors file in name order, its name, size,
  header (names, dtypes, shapes, offsets) and its first and last MiB of tensor data. Two models of one
  shape share headers but not values, and a fine-tune changes every tensor.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config.checkpoint_paths import MANIFEST, find_checkpoint

_SAMPLE = 1 << 20  # bytes of tensor data read at each end of a safetensors file


def weights_identity(source: str) -> str | None:
    """The identity of the weights `source` names (hf:DIR, or a longctx checkpoint: a step-* directory
    or a checkpoints directory for its latest), 16 hex digits; None when there is nothing to read."""
    h = hashlib.sha256()
    if source.startswith("hf:"):
        folder = Path(source.removeprefix("hf:"))
        config = folder / "config.json"
        if not config.is_file():
            return None
        h.update(config.read_bytes())
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(_safetensors_sample(f))
        return h.hexdigest()[:16]
    found = find_checkpoint(source)
    if found is None:
        return None
    files = json.loads((found / MANIFEST).read_text()).get("files", [])
    for entry in sorted(files, key=lambda e: e["path"]):
        h.update(f"{entry['path']}\0{entry['sha256']}\n".encode())
    return h.hexdigest()[:16]


def _safetensors_sample(path: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        head = f.read(header_len + _SAMPLE)  # the header and the first MiB of data
        f.seek(max(0, size - _SAMPLE))
        tail = f.read(_SAMPLE)
    return size.to_bytes(8, "little") + head + tail
