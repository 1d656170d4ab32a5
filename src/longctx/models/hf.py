"""Hugging Face Llama checkpoints <-> our model.

`load_hf(path)` reads a local directory (config.json + model.safetensors, or shards listed in
model.safetensors.index.json). Both RoPE config forms found in the wild are accepted: the classic
`rope_theta` + `rope_scaling`, and the newer `rope_parameters`. `save_hf(model, path)` writes a
directory that `transformers.LlamaForCausalLM.from_pretrained` loads.

Our RoPE uses the same "rotate half" layout as Hugging Face, so q/k weights map one to one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..errors import UserError
from .llama import Llama, build_model


class HFFormatError(UserError, ValueError):
    """The directory is not a Llama checkpoint we can read; the message says what is missing."""


# our name (with {i} for the layer) -> Hugging Face name
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
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


def hf_name(ours: str) -> str:
    if ours in _TOP_MAP:
        return _TOP_MAP[ours]
    _, i, rest = ours.split(".", 2)
    return f"model.layers.{i}.{_LAYER_MAP[rest]}"


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate a Hugging Face LlamaConfig dict into our ModelConfig."""
    arch = hf.get("model_type", "llama")
    if arch != "llama":
        raise HFFormatError(f"config.json has model_type '{arch}'; only 'llama' checkpoints are supported.")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFFormatError(f"config.json sets {flag}=true; longctx's Llama has no biases.")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"config.json has hidden_act '{hf['hidden_act']}'; only 'silu' (SwiGLU) is supported.")
    # Newer transformers write rope_parameters {rope_type, rope_theta, factor, ...}; older ones
    # write rope_theta at top level and rope_scaling {rope_type or type, factor, ...} (or null).
    rope = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    params = {**scaling, **rope}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise HFFormatError(f"rope type '{rope_type}' is not supported; longctx reads 'default' and 'llama3'.")
    heads = hf["num_attention_heads"]
    cfg = ModelConfig(
        preset="debug",
        dim=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling="llama3" if rope_type == "llama3" else "none",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        init_std=hf.get("initializer_range", 0.02),
    )
    if rope_type == "llama3":
        cfg.rope_factor = float(params["factor"])
        cfg.rope_low_freq_factor = float(params["low_freq_factor"])
        cfg.rope_high_freq_factor = float(params["high_freq_factor"])
        cfg.rope_original_max_len = int(params["original_max_position_embeddings"])
    return cfg


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return out


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise HFFormatError(f"{index} lists shards that are not in {path}: {', '.join(missing)}.")
        return {name: path / f for name, f in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in path.iterdir())
    raise HFFormatError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json (found: {', '.join(found) or 'nothing'}). "
        f"Only safetensors checkpoints are read."
    )


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Llama:
    """Read a local Hugging Face Llama directory into our model."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HFFormatError(f"{path} has no config.json; pass a Hugging Face model directory.")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    model = build_model(cfg, device="meta")
    files = _weight_files(path)
    state: dict[str, torch.Tensor] = {}
    wanted = {name: hf_name(name) for name in model.state_dict()}
    missing = [hf for hf in wanted.values() if hf not in files]
    if missing:
        raise HFFormatError(f"{path} lacks {len(missing)} expected tensors, e.g. {', '.join(missing[:3])}.")
    by_file: dict[Path, list[str]] = {}
    for ours, theirs in wanted.items():
        by_file.setdefault(files[theirs], []).append(ours)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for ours in names:
                state[ours] = f.get_tensor(wanted[ours]).to(dtype)
    model.to_empty(device=device)
    model.to(dtype)
    model.init_weights()  # sets non-persistent buffers (RoPE frequencies); weights are overwritten next
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HFFormatError(f"tensor {wanted[name]} has shape {tuple(tensor.shape)}, "
                                f"config.json implies {tuple(expected[name].shape)}.")
    model.load_state_dict(state, strict=True)
    model.inv_freq.data = model.inv_freq.float()
    return model


def save_hf(model: Llama, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json and safetensors weights (sharded above `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {hf_name(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    (path / "config.json").write_text(json.dumps(config_to_hf(model.cfg, dtype), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
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
