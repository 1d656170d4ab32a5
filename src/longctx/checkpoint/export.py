"""`longctx checkpoint export PATH --to hf OUT`: a complete checkpoint -> a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..models.hf import save_hf
from ..models.llama import build_model
from .manager import load_model_weights, resolve_checkpoint
from .manifest import CheckpointError, read_manifest


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    path = resolve_checkpoint(str(checkpoint), Path(checkpoint))
    if path is None:
        raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export.")
    manifest = read_manifest(path)
    cfg = ModelConfig(**{k: v for k, v in manifest["model"].items()})
    model = build_model(cfg, device="cpu", seed=None)
    load_model_weights(path, model)
    return save_hf(model.to(dtype), out)
