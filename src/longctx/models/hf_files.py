"""The safetensors files of a Hugging Face directory (models/hf.py reads them): which file holds each tensor
(model.safetensors, or the shards model.safetensors.index.json lists), each file opened and its header read
before any weight is, so a partial download, a damaged index, files of two revisions mixed or a single file
beside an index (two models) are one HFFormatError naming the file and the fix, said by train's preflight and
generate before any rank reads."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..config.hf import HFFormatError

__all__ = ["open_safetensors", "weight_files"]


def weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it; every file there and readable (its
    header read: a truncated file is refused here, before any weight is read)."""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file() and single.is_file():
        # (transformers reads the single file and ignores the index; a sharded save_pretrained over a single-file
        # save leaves both, and so does a single-file save over a sharded one: one of them is another model)
        raise HFFormatError(f"{path} holds both model.safetensors and model.safetensors.index.json, two sets of "
                            f"weights (a save into a directory that held another save leaves the old file or index "
                            f"behind); transformers reads model.safetensors and ignores the index. Remove the one "
                            f"that is not this model: model.safetensors, or the index with the shards it lists.")
    if index.is_file():
        weight_map = _read_weight_map(index)
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise HFFormatError(f"{index} lists shards that are not in {path}: {', '.join(missing)}. Copy the "
                                f"missing files (a partial download?) or re-save the model.")
        listed: dict[str, list[str]] = {}  # shard file -> the tensors the index places in it
        for name, f in weight_map.items():
            listed.setdefault(f, []).append(name)
        for f, names in sorted(listed.items()):
            with open_safetensors(path / f) as opened:
                held = set(opened.keys())
            absent = sorted(name for name in names if name not in held)
            if absent:  # (files of two revisions mixed: a bare SafetensorError at the first read, else)
                raise HFFormatError(f"{index} places {len(absent)} tensors in {f}, which does not hold them, e.g. "
                                    f"{', '.join(absent[:3])}: the index and the shards are of different versions "
                                    f"of the model (a partial re-download?). Download the index and every shard "
                                    f"again from one revision, or re-save the model.")
        return {name: path / f for name, f in weight_map.items()}
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in path.iterdir())
    raise HFFormatError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json "
        f"(found: {', '.join(found) or 'nothing'}). "
        f"Only safetensors checkpoints are read; convert .bin weights with save_pretrained(safe_serialization=True)."
    )


def _read_weight_map(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> shard file name), or one error naming the index: one cut short,
    or without a weight_map object, stopped every command with a bare JSONDecodeError / KeyError."""
    try:
        text = json.loads(index.read_text())
    except ValueError as e:
        why = f"is not valid JSON ({e})"
    else:
        weight_map = text.get("weight_map") if isinstance(text, dict) else None
        if isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values()):
            return weight_map
        why = "has no weight_map object (tensor name -> shard file)"
    raise HFFormatError(f"{index} {why}: it was cut short or damaged (a partial download?). Download it again "
                        f"with the shards, or re-save the model.")


def open_safetensors(file: Path):
    """safe_open of one safetensors file (on the CPU); a file cut short or damaged (safetensors checks that its
    header covers the file exactly) is one error naming it, not safetensors' traceback."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise HFFormatError(f"{file} is not a complete safetensors file ({e}): it was cut short or damaged (a "
                            f"partial download?). Download it again, or re-save the model.") from None
