"""`longctx checkpoint export PATH --to hf OUT`: a complete checkpoint -> a Hugging Face directory.

The manifest records the run's `[model]` (for `init_from = hf:DIR` runs: the imported family,
shapes and RoPE, with the extension overrides), so the export is the same family transformers
loads. The tokenizer goes along: the tokenizer files of the imported Hugging Face directory when it
still exists, else the tokenizer.json the run recorded; when there is none, the caller is told why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.hf import hf_dir, model_config
from ..config.hf_export import export_notes
from ..models.hf import copy_tokenizer_files, save_hf
from ..models.llama import build_model
from .manager import load_model_weights, resolve_checkpoint
from .manifest import CheckpointError, read_manifest


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30) -> tuple[Path, list[str], str, list[str]]:
    """(the written directory, the tokenizer files copied, why none were when none were, what config.json
    says differently from how the model trained: config/hf_export.py export_notes)."""
    path = resolve_checkpoint(str(checkpoint), Path(checkpoint))
    if path is None:
        raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export.")
    manifest = read_manifest(path)
    cfg = model_config(manifest["model"])  # (recorded by config key: "moe.experts")
    model = build_model(cfg, device="cpu", seed=None)
    load_model_weights(path, model)
    out = save_hf(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype)
    copied, why = _copy_tokenizer(cfg.init_from, manifest.get("tokenizer"), out)
    return out, copied, why, export_notes(cfg)


def _copy_tokenizer(init_from: str, recorded: str | None, out: Path) -> tuple[list[str], str]:
    if init_from.startswith("hf:") and hf_dir(init_from).is_dir():
        copied = copy_tokenizer_files(hf_dir(init_from), out)
        if copied:
            return copied, ""
    if recorded == "byte":
        return [], ("the run used longctx's byte tokenizer, which has no tokenizer files: transformers loads the "
                    "weights, but text must be encoded as UTF-8 bytes (256 = BOS, 257 = EOS)")
    if not recorded:
        return [], "the checkpoint records no tokenizer (written before longctx recorded one)"
    source = Path(recorded)
    if not (source / "tokenizer.json" if source.is_dir() else source).is_file():
        return [], f"the run's tokenizer {recorded} no longer exists"
    return copy_tokenizer_files(source, out), ""
