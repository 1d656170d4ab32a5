"""`longctx checkpoint export PATH --to hf OUT`: a complete checkpoint -> a Hugging Face directory.

The manifest records the run's `[model]` (for `init_from = hf:DIR` runs: the imported family,
shapes and RoPE, with the extension overrides), so the export is the same family transformers
loads; the tokenizer files of the imported directory are copied along when it still exists.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..config_hf import hf_dir
from ..models.hf import copy_tokenizer_files, save_hf
from ..models.llama import build_model
from .manager import load_model_weights, resolve_checkpoint
from .manifest import CheckpointError, read_manifest


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30) -> tuple[Path, list[str]]:
    """(the written directory, the tokenizer files copied)."""
    path = resolve_checkpoint(str(checkpoint), Path(checkpoint))
    if path is None:
        raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export.")
    manifest = read_manifest(path)
    fields = {f: manifest["model"][f] for f in ModelConfig.__dataclass_fields__ if f in manifest["model"]}
    cfg = ModelConfig(**fields)
    model = build_model(cfg, device="cpu", seed=None)
    load_model_weights(path, model)
    out = save_hf(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype)
    copied = []
    if cfg.init_from and hf_dir(cfg.init_from).is_dir():
        copied = copy_tokenizer_files(hf_dir(cfg.init_from), out)
    return out, copied
