"""Hugging Face config.json <-> the fields of `[model]`: which families and RoPE types longctx reads.

Pure dictionaries, no torch, so the config loader can resolve `model.init_from = "hf:DIR"` before
anything is built: the checkpoint's config.json becomes the run's `[model]` (family, shapes, RoPE),
the extension knobs the user set (rope_theta, RoPE scaling, max_seq_len) go on top, and a shape the
user set that contradicts the weights is refused.

Families are the Llama architecture with small differences:
- llama (Llama 2, 3, 3.1, 3.2): optional `attention_bias` on q, k, v and o;
- mistral: Llama with an explicit `head_dim`; sliding-window attention is not supported;
- qwen2 (Qwen2, Qwen2.5): bias on q, k and v (not o);
- qwen3: per-head RMSNorm on q and k before RoPE, explicit `head_dim`, optional `attention_bias`.
RoPE types: default, linear, llama3 and yarn, in the classic (`rope_theta` + `rope_scaling`) or the
newer (`rope_parameters`) form.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..checkpoint.paths import MANIFEST, CheckpointError, resolve_checkpoint
from ..errors import UserError


class HFFormatError(UserError, ValueError):
    """A Hugging Face directory or config.json that longctx cannot read; the message names the file or key."""

    exit_code = 2


# model_type -> the class transformers builds (written back on export)
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# [model] keys that extend a loaded model's context without contradicting its weights
EXTENSION_KEYS = frozenset({
    "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
    "rope_attention_factor", "rope_truncate", "max_seq_len", "init_std",
})
# how each weight-shaping [model] key reads in config.json (for the error that names both)
_HF_KEY = {
    "family": "model_type", "dim": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias", "out_bias": "attention_bias", "qk_norm": "model_type",
}


def hf_dir(init_from: str) -> Path:
    return Path(init_from.removeprefix("hf:"))


def read_hf_config(path: str | Path) -> dict:
    """DIR/config.json as a dict, or an error naming what is missing."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise HFFormatError(f"model.init_from: {path} is not a directory; pass hf:DIR, a local Hugging Face "
                            f"model directory holding config.json and safetensors weights.")
    if not cfg_file.is_file():
        raise HFFormatError(f"{path} has no config.json; pass a Hugging Face model directory (config.json and "
                            f"*.safetensors), e.g. one written by save_pretrained().")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{cfg_file} is not valid JSON: {e}.") from None


def _rope_params(hf: dict, where: str) -> tuple[str, dict]:
    """(rope type, its parameters with rope_theta) from either config.json form."""
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        kinds = sorted(rope)
        raise HFFormatError(f"{where}: rope_parameters is nested per layer type ({', '.join(kinds)}); longctx "
                            f"reads one RoPE setting for every layer.")
    params = {**(hf.get("rope_scaling") or {}), **(rope or {})}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFFormatError(f"{where}: RoPE type '{kind}' is not supported; longctx reads {', '.join(ROPE_TYPES)}. "
                            f"Convert the checkpoint or pick a model that uses one of these.")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFFormatError(f"{where}: partial_rotary_factor={partial}; longctx rotates the whole head.")
    return kind, params


def _rope_fields(hf: dict, where: str) -> dict[str, Any]:
    kind, p = _rope_params(hf, where)
    out: dict[str, Any] = {"rope_theta": float(p["rope_theta"]),
                           "rope_scaling": "none" if kind == "default" else kind}
    # the pretraining length: a top-level original_max_position_embeddings wins (transformers' rule)
    original = hf.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings", 0) or 0)

    def need(key):
        if p.get(key) is None:
            raise HFFormatError(f"{where}: RoPE type '{kind}' needs '{key}' in its rope settings.")
        return p[key]

    if kind == "linear":
        out["rope_factor"] = float(need("factor"))
    elif kind == "llama3":
        out.update(rope_factor=float(need("factor")), rope_low_freq_factor=float(need("low_freq_factor")),
                   rope_high_freq_factor=float(need("high_freq_factor")), rope_original_max_len=original)
    elif kind == "yarn":
        factor = p.get("factor")
        if factor is None:  # DeepSeek-style: the ratio of the two lengths
            factor = hf["max_position_embeddings"] / original
        out.update(rope_factor=float(factor), rope_original_max_len=original,
                   rope_beta_fast=float(p.get("beta_fast") or 32.0), rope_beta_slow=float(p.get("beta_slow") or 1.0),
                   rope_mscale=float(p.get("mscale") or 0.0), rope_mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
                   rope_attention_factor=float(p.get("attention_factor") or 0.0),
                   rope_truncate=bool(p.get("truncate", True)))
    return out


def _reject_sliding_window(hf: dict, family: str, where: str) -> None:
    layer_types = hf.get("layer_types") or []
    sliding = "sliding_attention" in layer_types
    if family in ("qwen2", "qwen3"):
        sliding = sliding or bool(hf.get("use_sliding_window"))
    elif family == "mistral":
        window = hf.get("sliding_window")
        sliding = sliding or (window is not None and window < hf.get("max_position_embeddings", 0))
    if sliding:
        raise HFFormatError(f"{where}: the model uses sliding-window attention (sliding_window="
                            f"{hf.get('sliding_window')}); longctx trains full causal attention only.")


def model_fields_from_hf(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """The [model] fields that describe the checkpoint `hf` (a parsed config.json)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFFormatError(f"{where}: model_type '{family}' is not supported; longctx reads "
                            f"{', '.join(FAMILIES)} (the Llama architecture and its close variants).")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in hf:
            raise HFFormatError(f"{where}: the required key '{key}' is missing.")
    if hf.get("mlp_bias"):
        raise HFFormatError(f"{where}: mlp_bias=true; longctx's feed-forward has no biases.")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFFormatError(f"{where}: hidden_act '{act}'; only 'silu' (SwiGLU) is supported.")
    _reject_sliding_window(hf, family, where)
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    fields = dict(
        family=family,
        dim=hf["hidden_size"], layers=hf["num_hidden_layers"], heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else bias,
        out_bias=False if family == "qwen2" else bias,
        qk_norm=family == "qwen3",
        max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    fields.update(_rope_fields(hf, where))
    return fields


def hf_config_from_model(m, dtype_name: str = "float32") -> dict:
    """config.json for the [model] `m` (a ModelConfig), in the newer rope_parameters form plus the
    classic rope_theta / rope_scaling keys, so old and new transformers read it."""
    rope: dict[str, Any] = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling,
                            "rope_theta": m.rope_theta}
    if m.rope_scaling in ("linear", "llama3", "yarn"):
        rope["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        rope.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    if m.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=m.rope_original_max_len, beta_fast=m.rope_beta_fast,
                    beta_slow=m.rope_beta_slow, truncate=m.rope_truncate)
        for key, value in (("mscale", m.rope_mscale), ("mscale_all_dim", m.rope_mscale_all_dim),
                           ("attention_factor", m.rope_attention_factor)):
            if value:
                rope[key] = value
    out = {
        "architectures": [FAMILIES[m.family]], "model_type": m.family,
        "hidden_size": m.dim, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.resolved_head_dim, "intermediate_size": m.ffn_dim,
        "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": m.max_seq_len, "initializer_range": m.init_std, "hidden_act": "silu",
        "rope_theta": m.rope_theta, "rope_parameters": rope,
        "rope_scaling": None if m.rope_scaling == "none" else dict(rope),
        "torch_dtype": dtype_name, "dtype": dtype_name,
    }
    if m.family != "qwen2":
        out["attention_bias"] = m.qkv_bias
    if m.family == "llama":
        out["mlp_bias"] = False
    if m.family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if m.family == "mistral":
        out["sliding_window"] = None
    return out


def _checkpoint_model(init_from: str) -> tuple[Path, dict]:
    """(the checkpoint directory, its manifest's [model]) for init_from = a longctx checkpoint."""
    path, manifest = checkpoint_manifest(init_from)
    try:
        return path, manifest["model"]
    except (KeyError, TypeError) as e:
        raise HFFormatError(f"model.init_from: {path / 'manifest.json'} cannot be read ({e}).") from None


def checkpoint_manifest(init_from: str) -> tuple[Path, dict]:
    """(the checkpoint directory, its manifest) for init_from = a longctx checkpoint."""
    try:
        path = resolve_checkpoint(init_from, Path(init_from))
    except CheckpointError:
        path = None
    if path is None:
        raise HFFormatError(f"model.init_from = {init_from!r} holds no complete longctx checkpoint (a step-* directory "
                            f"with {MANIFEST}, or a checkpoints directory); for Hugging Face weights write hf:DIR.")
    try:  # (its checksums are verified when the weights are loaded)
        return path, json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise HFFormatError(f"model.init_from: {path / MANIFEST} cannot be read ({e}).") from None


def resolve_init_from(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """[model] values as the user gave them (init_from set) -> (the run's [model] values, what the
    user's extension keys changed). The weights' own description decides family, shapes and RoPE:
    config.json for `hf:DIR`, the manifest's [model] for a longctx checkpoint directory. Extension
    keys apply on top; a weight-shaping key that disagrees is an HFFormatError naming both values."""
    source = values["init_from"]
    if source.startswith("hf:"):
        path = hf_dir(source)
        hf = read_hf_config(path)
        where = path / "config.json"
        fields = model_fields_from_hf(hf, str(where))
        preset = "hf"

        def stored(key):
            return f"config.json has {_HF_KEY.get(key, key)}={hf.get(_HF_KEY.get(key, key))!r}"
    else:
        path, model = _checkpoint_model(source)
        where = path / "manifest.json"
        preset = model.get("preset", "debug")
        fields = {k: v for k, v in model.items() if k not in ("preset", "init_from")}

        def stored(key):
            return f"its manifest has model.{key}={fields[key]!r}"
    changed = []
    for key, value in values.items():
        if key == "init_from":
            continue
        if key == "preset":  # a named shape (e.g. from a recipe's [model]) yields to the weights' own
            if value != preset:
                changed.append(f"model.preset {value!r} replaced by the shapes of {where}")
            continue
        if key in EXTENSION_KEYS:
            if fields.get(key) != value:
                changed.append(f"model.{key}: {fields.get(key)!r} -> {value!r}")
            fields[key] = value
        elif key in fields and fields[key] != value and not (isinstance(value, (int, float)) and
                                                             not isinstance(value, bool) and
                                                             float(fields[key]) == float(value)):
            raise HFFormatError(
                f"model.{key}={value!r} contradicts the weights in {path}: {stored(key)}, so model.{key} must be "
                f"{fields[key]!r}. Drop the override; only context-extension keys "
                f"({', '.join(sorted(EXTENSION_KEYS))}) may differ from the weights.")
    fields.update(preset=preset, init_from=source)
    return fields, changed

