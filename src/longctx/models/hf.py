"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) <-> our model.

`load_hf(path)` reads a local directory (config.json + model.safetensors, or shards listed in
model.safetensors.index.json) into a new single-process model. `load_hf_weights(model, path)` fills
an existing model that may already be sharded by FSDP: each rank reads, from the memory-mapped
safetensors files, only the rows of each tensor it owns (`safe_open(...).get_slice`), so no rank
ever holds the whole checkpoint. `save_hf(model, path)` writes the same family's config.json and
safetensors (sharded above a size, with an index) that transformers loads.

config.json is translated by config/hf.py (both RoPE forms, every supported RoPE type). Our RoPE
uses the same "rotate half" layout as Hugging Face, so q/k weights map one to one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..config.hf import HFFormatError, hf_config_from_model, model_fields_from_hf, read_hf_config
from .llama import Llama, build_model
from .shards import local_part, local_slices

__all__ = ["HFFormatError", "config_from_hf", "hf_name", "load_hf", "load_hf_weights", "save_hf", "weight_files",
           "copy_tokenizer_files"]

# our name (within layer i) -> Hugging Face name (within model.layers.i)
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# files a Hugging Face tokenizer may consist of; copied next to exported weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def hf_name(ours: str) -> str:
    if ours in _TOP_MAP:
        return _TOP_MAP[ours]
    _, i, rest = ours.split(".", 2)
    return f"model.layers.{i}.{_LAYER_MAP[rest]}"


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A parsed Hugging Face config.json -> our ModelConfig."""
    return ModelConfig(**model_fields_from_hf(hf, where), preset="hf")


def weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise HFFormatError(f"{index} lists shards that are not in {path}: {', '.join(missing)}. Copy the "
                                f"missing files (a partial download?) or re-save the model.")
        return {name: path / f for name, f in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in path.iterdir())
    raise HFFormatError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json "
        f"(found: {', '.join(found) or 'nothing'}). "
        f"Only safetensors checkpoints are read; convert .bin weights with save_pretrained(safe_serialization=True)."
    )


@torch.no_grad()
def load_hf_weights(model: Llama, path: str | Path) -> None:
    """Fill `model` (materialised, possibly FSDP-sharded) from the safetensors in `path`, each rank
    reading only the part of every tensor it holds."""
    path = Path(path)
    files = weight_files(path)
    params = dict(model.named_parameters())
    wanted = {ours: hf_name(ours) for ours in params}
    missing = [theirs for theirs in wanted.values() if theirs not in files]
    if missing:
        raise HFFormatError(f"{path} lacks {len(missing)} tensors that config.json implies, e.g. "
                            f"{', '.join(missing[:3])}; the weights and config.json disagree.")
    by_file: dict[Path, list[str]] = {}
    for ours, theirs in wanted.items():
        by_file.setdefault(files[theirs], []).append(ours)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for ours in names:
                p, theirs = params[ours], wanted[ours]
                stored = f.get_slice(theirs)
                shape = tuple(stored.get_shape())
                if shape != tuple(p.shape):
                    raise HFFormatError(f"{file.name}: tensor {theirs} has shape {shape}, config.json implies "
                                        f"{tuple(p.shape)}.")
                local = local_part(p)
                local.copy_(stored[local_slices(p)].to(local.dtype))
    model.init_rope()


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Llama:
    """Read a local Hugging Face directory into a new single-process model."""
    path = Path(path)
    cfg = config_from_hf(read_hf_config(path), str(path / "config.json"))
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    load_hf_weights(model, path)
    if dtype != torch.float32:
        model.to(dtype)
        model.init_rope()  # RoPE frequencies stay fp32
    return model


def copy_tokenizer_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copy the tokenizer files found in `source` (a Hugging Face directory, or a tokenizer.json
    file) into `dest`; the names copied."""
    source = Path(source)
    candidates = [source] if source.is_file() else [source / name for name in TOKENIZER_FILES]
    copied = []
    for file in candidates:
        if file.is_file():
            shutil.copyfile(file, Path(dest) / file.name)
            copied.append(file.name)
    return copied


def save_hf(model: Llama, path: str | Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
            tokenizer_from: str | Path | None = None) -> Path:
    """Write config.json and safetensors weights (sharded above `max_shard_bytes`, with an index),
    in `dtype` (default: the model's), plus the tokenizer files of `tokenizer_from` if given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {hf_name(k): v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_config_from_model(model.cfg, dtype_name), indent=2) + "\n")
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()  # a previous export into the same directory must not leave shards behind
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if tokenizer_from:
        copy_tokenizer_files(tokenizer_from, path)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path
