"""Which weights a path holds, as a short identity: what a GliDe draft records of the target it was
trained against, so that a draft is never used beside another target of the same shape (a later
step of the same run, a fine-tune, another seed: each would drop its acceptance without a word).

- A longctx checkpoint: sha256 over its manifest's file list (each file's path and sha256, which
  the manifest already holds: nothing is read but the manifest). A copy of the checkpoint has the
  same identity; another step of the same run does not.
- hf:DIR: a fingerprint, not a full hash (a full one would read every byte of a many-GB model at
  every `generate`), in two parts "ENDS.TENSORS": ENDS sha256 over config.json and, per safetensors
  file in name order, its name, size, header (names, dtypes, shapes, offsets) and its first and last MiB
  of tensor data; TENSORS sha256 over every tensor's name and _PIECES pieces of its data spread over it.
  Two models of one shape share headers but not values. ENDS alone missed a fine-tune that leaves the
  file's ends alone: a LoRA merged into the attention's q and k (the embedding first in the file and the
  last layer's v_proj and the final norm last unchanged) kept it, so a draft was used beside a target it
  never learned from. A draft recorded before TENSORS existed holds ENDS alone and is compared by it
  (`same_weights`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..config.checkpoint_paths import MANIFEST, find_checkpoint

_SAMPLE = 1 << 20  # bytes of tensor data read at each end of a safetensors file
_PIECES, _PIECE = 16, 1024  # pieces of each tensor's data read for TENSORS, and their bytes (~16 KiB a tensor)


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
        files = sorted(folder.glob("*.safetensors"))
        for f in files:
            h.update(f.name.encode())
            h.update(_safetensors_sample(f))
        return f"{h.hexdigest()[:16]}.{_tensor_samples(files)}"
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


def same_weights(recorded: str | None, given: str | None) -> bool:
    """Whether the identity `given` (weights_identity's now) names the weights of the identity `recorded` (a
    draft's record, perhaps written before hf:DIR identities had their TENSORS part: then compared by ENDS)."""
    if recorded is None or given is None or ("." in recorded) == ("." in given):
        return recorded == given
    return recorded.split(".")[0] == given.split(".")[0]


def _tensor_samples(files: list[Path]) -> str:
    """TENSORS of an hf:DIR identity: sha256 over each tensor's name and _PIECES pieces of _PIECE bytes spread
    evenly over its data (all of it when smaller), per safetensors file in name order."""
    h = hashlib.sha256()
    for path in files:
        with path.open("rb", buffering=0) as f:  # (unbuffered, by pread: each piece one small read, no buffer fill)
            header_len = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(header_len))
                spans = {name: tuple(header[name]["data_offsets"]) for name in header if name != "__metadata__"}
            except (ValueError, KeyError, TypeError, AttributeError):  # (not a safetensors header: ENDS holds it)
                h.update(b"unreadable header\n")
                continue
            for name in sorted(spans):
                start, end = spans[name]
                h.update(f"{name}\0".encode())
                for offset in _piece_offsets(end - start):
                    h.update(os.pread(f.fileno(), min(_PIECE, end - start - offset), 8 + header_len + start + offset))
    return h.hexdigest()[:16]


def _piece_offsets(size: int) -> list[int]:
    """Where TENSORS reads a tensor of `size` bytes: _PIECES pieces from its start to its end."""
    if size <= _PIECES * _PIECE:
        return list(range(0, size, _PIECE))
    step = (size - _PIECE) / (_PIECES - 1)
    return [round(i * step) for i in range(_PIECES)]
