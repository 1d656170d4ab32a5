"""Hugging Face config.json <-> the fields of `[model]`: which families and RoPE types longctx reads.

Pure dictionaries, no torch, so the config loader can resolve `model.init_from = "hf:DIR"` before
anything is built: the checkpoint's config.json becomes the run's `[model]` (family, shapes, RoPE),
the extension knobs the user set (rope_theta, RoPE scaling, max_seq_len) go on top, and a shape the
user set that contradicts the weights is refused.

Families are the Llama architecture with small differences:
- llama (Llama 2, 3, 3.1, 3.2): optional `attention_bias` on q, k, v and o;
- mistral: Llama with an explicit `head_dim`, no attention biases; its sliding window (4096 when config.json
  has none) must not bind within the run's max_seq_len (longctx has no sliding-window attention);
- qwen2 (Qwen2, Qwen2.5): bias on q, k and v (not o);
- qwen3: per-head RMSNorm on q and k before RoPE, explicit `head_dim`, optional `attention_bias`.
and the Mixture-of-Experts ones ([model.moe], models/moe.py; every one a softmax router, top-k):
- mixtral: `num_local_experts` experts of width `intermediate_size`, top-k weights renormalised;
- qwen2_moe (Qwen1.5-MoE, Qwen2-MoE): `num_experts` of width `moe_intermediate_size`, one shared
  expert of width `shared_expert_intermediate_size` behind a sigmoid gate, dense layers of width
  `intermediate_size` where `mlp_only_layers` and `decoder_sparse_step` say, `norm_topk_prob`,
  bias on q, k and v (`qkv_bias`);
- qwen3_moe: the same without a shared expert, with Qwen3's attention (per-head q/k norm);
- olmoe: `num_experts` of width `intermediate_size`, RMSNorm on the whole q and k projections
  (model.qk_norm_span = all), optional `attention_bias`; `clip_qkv` is not supported.
The router losses are what transformers' training of the model would add: with `output_router_logits`
true, moe.aux_loss = `router_aux_loss_coef` and moe.aux_loss_scope = pooled (its load_balancing_loss_func:
every layer's routing pooled before the product, each of a token's k choices counted); with it
false (transformers' default, and the published configs') there is none: moe.aux_loss = 0.
`router_z_loss_coef` is moe.z_loss whatever output_router_logits says: transformers' classes of these
families never write or read it, so it is there only where longctx's export wrote a z-loss the model
trained with (a transformers config has none: moe.z_loss = 0, as transformers trains).
`router_loss_note` says which, once, when a run starts from the weights.
`pad_token_id` (OLMoE's class default 1 where the file has none) is model.padding_idx: every family's transformers
embedding takes it as nn.Embedding's padding_idx, whose row gets no gradient, and so does longctx's.
RoPE types: default, linear, llama3 and yarn, in the classic (`rope_theta` + `rope_scaling`) or the
newer (`rope_parameters`) form (config/hf_rope.py). A key config.json leaves out is the family's
default in transformers (config/hf_families.py), not longctx's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .checkpoint_paths import MANIFEST, CheckpointError, find_checkpoint, moved_aside_note
from .hf_families import (
    FAMILIES,
    MOE_DEFAULTS,
    HFFormatError,
    check_heads,
    check_hf_values,
    check_moe_values,
    check_sliding_window,
    check_unquantized,
    embedding_padding_idx,
    experts_key,
    family_window,
    qwen_moe_dense_layers,
    with_family_defaults,
)
from .hf_rope import config_reach, linear_reach, rope_fields
from .schema import MOE_FAMILIES, ModelConfig

# [model] keys that extend a loaded model's context without contradicting its weights
EXTENSION_KEYS = frozenset({
    "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
    "rope_attention_factor", "rope_truncate", "max_seq_len", "init_std",
    # Ms-PoE (models/ms_poe.py): positions at inference, not the weights
    "rope_ms_poe", "rope_ms_poe_min", "rope_ms_poe_max", "rope_ms_poe_order", "rope_ms_poe_skip_layers",
})
# [model] keys that change how a loaded model trains, not what its weights compute: free too
TRAINING_KEYS = frozenset({"moe.aux_loss", "moe.aux_loss_scope", "moe.z_loss", "moe.capacity_factor",
                           "moe.bias_update_rate", "padding_idx"})
# how each weight-shaping [model] key reads in config.json (for the error that names both);
# a key whose name depends on the family maps to {family: name}
_HF_KEY: dict[str, Any] = {
    "family": "model_type", "dim": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": {"qwen2_moe": "qkv_bias", None: "attention_bias"}, "out_bias": "attention_bias",
    "qk_norm": "model_type", "qk_norm_span": "model_type",
    "moe.experts": {None: "model_type"},  # (the MoE families: experts_key)
    "moe.top_k": {None: "num_experts_per_tok"},
    "moe.expert_dim": {"qwen2_moe": "moe_intermediate_size", "qwen3_moe": "moe_intermediate_size",
                       None: "intermediate_size"},
    "moe.shared_experts": {None: "shared_expert_intermediate_size"},
    "moe.shared_dim": {None: "shared_expert_intermediate_size"},
    "moe.shared_gate": {None: "shared_expert_intermediate_size"},
    "moe.dense_layers": {None: "mlp_only_layers"},
    "moe.norm_topk": {"mixtral": "model_type", None: "norm_topk_prob"},
}


def _hf_key(key: str, family: str | None, hf: dict | None = None) -> str:
    if key == "moe.experts" and family in MOE_FAMILIES:
        return experts_key(hf or {}, family)
    name = _HF_KEY.get(key, "model_type")
    return name.get(family, name[None]) if isinstance(name, dict) else name


def hf_dir(init_from: str) -> Path:
    return Path(init_from.removeprefix("hf:"))


def read_hf_config(path: str | Path) -> dict:
    """DIR/config.json as a dict, or an error naming what is missing."""
    path = Path(path)
    cfg_file = path / "config.json"
    if path.is_file() and path.suffix == ".gguf":
        raise HFFormatError(f"{path} is a GGUF file; longctx reads Hugging Face directories. Convert it once with "
                            f"`longctx checkpoint import {path} --out DIR`, then pass hf:DIR.")
    if not path.is_dir():
        raise HFFormatError(f"model.init_from: {path} is not a directory; pass hf:DIR, a local Hugging Face "
                            f"model directory holding config.json and safetensors weights.")
    if not cfg_file.is_file():
        raise HFFormatError(f"{path} has no config.json; pass a Hugging Face model directory (config.json and "
                            f"*.safetensors), e.g. one written by save_pretrained().")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{cfg_file} is not valid JSON: {e}.") from None
    if not isinstance(hf, dict):  # (a list or a number: every reader's .get was an AttributeError traceback)
        raise HFFormatError(f"{cfg_file} holds a JSON {type(hf).__name__}, not an object of the model's keys "
                            f"(model_type, hidden_size, ...); pass a Hugging Face model directory whose config.json "
                            f"save_pretrained() wrote.")
    check_hf_values(hf, str(cfg_file))  # (before any reader computes with them: default_max_seq_len is first)
    return hf


def format_layer_list(layers) -> str:
    """{0, 3, 4, 5} -> "0,3-5" (what parse_layer_list reads back)."""
    out, run = [], []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def _moe_fields(hf: dict, family: str, where: str) -> dict[str, Any]:
    """The [model.moe] keys of a Mixture-of-Experts config.json (config keys: "moe.experts", ...)."""
    check_moe_values(hf, where)  # (every value below computed with is the type it is read as)
    d = {**MOE_DEFAULTS[family], **{k: v for k, v in hf.items() if v is not None}}
    if family == "mixtral":  # (router_jitter_noise, training's alone in transformers: init_from_notes)
        experts, expert_dim, norm_topk = d.get(experts_key(hf, family), 8), hf["intermediate_size"], True
    else:
        experts, norm_topk = d.get(experts_key(hf, family), d["num_experts"]), bool(d["norm_topk_prob"])
        expert_dim = d["moe_intermediate_size"] if family in ("qwen2_moe", "qwen3_moe") else hf["intermediate_size"]
    if experts <= 0:
        raise HFFormatError(f"{where}: {_hf_key('moe.experts', family, hf)}={experts}, a {family} without experts; "
                            f"longctx reads a dense model as its dense family (qwen2, qwen3, llama).")
    top_k = d["num_experts_per_tok"]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        # (transformers builds such a model and fails in its forward's top-k; read here, load_hf built it too and
        # the run's rules named model.moe.top_k, a key the user never set)
        count = _hf_key("moe.experts", family, hf)
        raise HFFormatError(f"{where}: num_experts_per_tok={json.dumps(top_k)} with {count}={experts}: each token "
                            f"chooses between 1 and {experts} experts, so no model computes it; set it to the number "
                            f"of experts the weights were trained to choose.")
    dense = qwen_moe_dense_layers(d, where) if family in ("qwen2_moe", "qwen3_moe") else set()
    shared = int(d.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return {"moe.experts": int(experts), "moe.top_k": int(d["num_experts_per_tok"]), "moe.router": "softmax",
            "moe.expert_dim": int(expert_dim), "moe.shared_experts": int(shared > 0), "moe.shared_dim": shared,
            "moe.shared_gate": shared > 0, "moe.dense_layers": format_layer_list(dense), "moe.norm_topk": norm_topk,
            "moe.route_scale": 1.0, "moe.groups": 1, "moe.topk_groups": 1, **_router_loss_fields(d)}


def _router_loss_fields(d: dict) -> dict[str, Any]:
    """The router losses transformers' training adds (config.json with the family's defaults: `d`):
    none unless output_router_logits, then its pooled balancing loss at router_aux_loss_coef; and the
    z-loss of a longctx export (router_z_loss_coef, a key only longctx writes)."""
    on = bool(d.get("output_router_logits"))
    return {"moe.aux_loss": float(d.get("router_aux_loss_coef") or 0.0) if on else 0.0,
            "moe.aux_loss_scope": "pooled", "moe.z_loss": float(d.get("router_z_loss_coef") or 0.0)}


def router_loss_note(hf: dict) -> str:
    """What a MoE config.json makes of the router losses, in words (said once when a run starts from it)."""
    family = hf.get("model_type")
    d = {**MOE_DEFAULTS.get(family, {}), **{k: v for k, v in hf.items() if v is not None}}
    fields = _router_loss_fields(d)
    z = (f"; and model.moe.z_loss {fields['moe.z_loss']} from router_z_loss_coef, a key longctx's export writes and "
         f"transformers never reads (its training of {family} adds no z-loss)" if fields["moe.z_loss"] else "")
    if not d.get("output_router_logits"):
        return (f"router losses as transformers trains {family}: config.json has output_router_logits=false, so no "
                f"load-balancing loss (model.moe.aux_loss 0; router_aux_loss_coef={d.get('router_aux_loss_coef')} "
                f"applies only with output_router_logits); --model.moe.aux_loss W adds transformers' pooled one{z}")
    return (f"router losses as transformers trains {family}: config.json has output_router_logits=true, so its "
            f"load-balancing loss, model.moe.aux_loss {fields['moe.aux_loss']} (router_aux_loss_coef) with "
            f"model.moe.aux_loss_scope pooled (every layer's routing pooled, each of the k choices counted){z}")


def init_from_notes(init_from: str) -> list[str]:
    """What the weights' own description implies for training beyond their shapes (a MoE config.json's
    router losses), for the line that names where the weights came from."""
    if not init_from.startswith("hf:"):
        return []
    hf = read_hf_config(hf_dir(init_from))
    notes = [router_loss_note(hf)] if hf.get("model_type") in MOE_FAMILIES else []
    dropout = {k: hf[k] for k in DROPOUT_KEYS if isinstance(hf.get(k), (int, float)) and hf[k] > 0}
    if dropout:  # (transformers applies them in training; a fine-tune here would differ from one there)
        notes.append(f"config.json sets {', '.join(f'{k}={v}' for k, v in dropout.items())}: longctx trains "
                     f"without dropout (none of its layers applies one), as most long-context recipes do")
    jitter = hf.get("router_jitter_noise") if hf.get("model_type") == "mixtral" else None
    if isinstance(jitter, (int, float)) and jitter > 0:  # (as dropout: inference applies none, so eval and
        # generate read the model as transformers does; a fine-tune here differs from one there in that alone)
        notes.append(f"config.json sets router_jitter_noise={jitter}: longctx's router trains without it (no random "
                     f"noise on the router's input), as transformers' own inference routes")
    return notes


DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def _dense_moe_fields() -> dict[str, Any]:
    """A dense family's [model.moe] keys: no experts, every other key its default."""
    return {key: default for key, default in model_defaults().items() if key.startswith("moe.")}


def model_config(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from [model] values named by config key ("moe.experts"), such as
    model_fields_from_hf gives or a manifest records; keys it does not know are left out."""
    names = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{names[k]: v for k, v in values.items() if k in names})


def model_defaults() -> dict[str, Any]:
    """Every [model] key (config names: "moe.experts") with its default."""
    return {f.metadata.get("key", f.name): f.default for f in dataclasses.fields(ModelConfig)}


def model_fields_from_hf(hf: dict, where: str = "config.json", max_seq_len: int | None = None) -> dict[str, Any]:
    """The [model] values that describe the checkpoint `hf` (a parsed config.json, a key it leaves out
    read as its family's default), by config key ("moe.experts", as a TOML file or the command line
    names them); `max_seq_len`: the run's (a sliding window must not bind within it; None: the weights' own
    max_position_embeddings must not pass it either)."""
    family = hf.get("model_type")
    check_hf_values(hf, where)  # (the family, the shapes, every number a number; rope_theta: hf_rope.py)
    check_unquantized(hf, where)
    if hf.get("mlp_bias"):
        raise HFFormatError(f"{where}: mlp_bias=true; longctx's feed-forward has no biases, and the model cannot "
                            f"be read without dropping them (its outputs would change): it is not supported.")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # (transformers' "swish" is the same function: torch's SiLU)
        raise HFFormatError(f"{where}: hidden_act '{act}'; only 'silu' / 'swish' (SwiGLU's gate) is supported: "
                            f"a model with another activation cannot be read as it computes.")
    check_sliding_window(hf, where, max_seq_len)
    if family == "mistral" and hf.get("attention_bias"):
        raise HFFormatError(f"{where}: attention_bias=true, but transformers' Mistral has no attention biases (it "
                            f"ignores the key and drops the bias tensors). Set it false to load the model as "
                            f"transformers does, or model_type llama (the same model, with biases) to keep them.")
    hf = with_family_defaults(hf)
    if hf.get("clip_qkv") is not None:
        raise HFFormatError(f"{where}: clip_qkv={hf['clip_qkv']}; longctx does not clamp q, k and v. Use a "
                            f"checkpoint trained without it (clip_qkv null).")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if family == "olmoe" and head_dim * heads != hf["hidden_size"]:
        raise HFFormatError(f"{where}: head_dim={head_dim} x {heads} heads is not hidden_size={hf['hidden_size']}; "
                            f"OLMoE's q/k norms span hidden_size, so transformers itself cannot build it.")
    bias = bool(hf.get("attention_bias", False))
    qkv_bias, out_bias = {"qwen2": (True, False), "qwen2_moe": (bool(hf.get("qkv_bias", True)), False),
                          "mixtral": (False, False)}.get(family, (bias, bias))
    fields = dict(
        family=family,
        dim=hf["hidden_size"], layers=hf["num_hidden_layers"], heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), padding_idx=embedding_padding_idx(hf),
        qkv_bias=qkv_bias, out_bias=out_bias,
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_span="all" if family == "olmoe" else "head",
        max_seq_len=int(hf["max_position_embeddings"]),
        init_std=0.02 if hf.get("initializer_range") is None else float(hf["initializer_range"]),
    )
    fields.update(rope_fields(hf, where))
    if fields["rope_scaling"] == "linear":  # (a linear config.json gives the length before its factor: positions.py)
        fields["max_seq_len"] = linear_reach(fields["max_seq_len"], fields["rope_factor"])
    fields.update(_moe_fields(hf, family, where) if family in MOE_FAMILIES else _dense_moe_fields())
    return fields


def default_max_seq_len(hf: dict) -> int:
    """model.max_seq_len when the run gives none: max_position_embeddings, or the sliding window where it binds
    below that (Mistral-7B-v0.1's 4,096 of 32,768). longctx has no sliding-window attention, so the weights
    compute as trained only within the window; defaulting past it refused every command, a prompt of a few tokens
    too. A length the user gives past the window is still refused (check_sliding_window). The one place a run's
    default is decided: resolve_init_from, where what the user gave is known."""
    hf = with_family_defaults(hf)
    length, window = config_reach(hf), family_window(hf)
    return min(length, window) if window else length


def check_run_window(init_from: str, longest: int) -> None:
    """A run's `longest` sequence (train.seq_len, or its longest stage's) past the sliding window of the weights
    it starts from, said as the window's refusal: with model.max_seq_len defaulted to the window
    (default_max_seq_len), the rule of train.seq_len against it said "raise model.max_seq_len", which the
    window then refuses."""
    origin = initial_hf_config(init_from) if init_from else None
    if origin is not None:
        check_sliding_window(origin, f"model.init_from = {init_from!r}", longest, "train.seq_len")


def _checkpoint_model(init_from: str) -> tuple[Path, dict]:
    """(the checkpoint directory, its manifest's [model]) for init_from = a longctx checkpoint."""
    path, manifest = checkpoint_manifest(init_from)
    if isinstance(manifest, dict) and manifest.get("draft"):
        target = manifest["draft"].get("target", {}).get("path")
        # (named by the path alone: generate --checkpoint, eval and bench reach here too, not only model.init_from)
        named = f"{init_from!r}" + (f" ({path})" if str(path) != init_from else "")
        kind = "Clover" if manifest["draft"].get("kind") == "clover" else "GliDe"
        raise HFFormatError(
            f"{named} is a {kind} draft's checkpoint (trained against {target!r}), not a model to start "
            f"from, evaluate or generate with: a draft is used beside its target (`longctx generate --checkpoint "
            f"{target or 'TARGET'} --draft {init_from}`), and draft.target names the target itself.")
    try:
        return path, manifest_model(manifest, path)
    except (KeyError, TypeError) as e:
        raise HFFormatError(f"model.init_from: {path / 'manifest.json'} cannot be read ({e}).") from None


def manifest_model(manifest: dict, where: Path) -> dict:
    """A checkpoint manifest's [model], refused where it records a key this longctx does not know. No key has
    left ModelConfig, so such a key was written by a newer longctx, whose model computes with it: built
    without it (model_config leaves unknown keys out) the weights would load into another function, and an
    export, generate or fine-tune would go on without a word."""
    model = manifest["model"]
    unknown = sorted(set(model) - set(model_defaults()))
    if unknown:
        raise CheckpointError(
            f"checkpoint {where} records model settings this longctx does not know ({', '.join(unknown)}): it was "
            f"written by a newer longctx, and its model computes with them. Read it with that version or a newer "
            f"one. Nothing was loaded.")
    return model


def checkpoint_manifest(init_from: str) -> tuple[Path, dict]:
    """(the checkpoint directory, its manifest) for init_from = a longctx checkpoint."""
    path = find_checkpoint(init_from)
    if path is None:
        raise HFFormatError(f"model.init_from = {init_from!r} holds no complete longctx checkpoint (a step-* directory "
                            f"with {MANIFEST}, or a checkpoints directory); for Hugging Face weights write hf:DIR."
                            f"{moved_aside_note(init_from)}")
    try:  # (its checksums are verified when the weights are loaded)
        return path, json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise HFFormatError(f"model.init_from: {path / MANIFEST} cannot be read ({e}).") from None


def initial_hf(init_from: str, depth: int = 16) -> str:
    """The hf:DIR the weights started from: init_from itself, or through the chain of longctx checkpoints
    that started from one another ('' from scratch, or where a manifest of the chain cannot be read)."""
    for _ in range(depth):
        if not init_from or init_from.startswith("hf:"):
            return init_from or ""
        try:
            init_from = checkpoint_manifest(init_from)[1]["model"].get("init_from", "")
        except (HFFormatError, KeyError, TypeError, AttributeError):
            return ""
    return ""


def initial_hf_config(init_from: str, depth: int = 16) -> dict | None:
    """The Hugging Face config.json the weights started from (initial_hf; None: from scratch, or the
    directory is gone)."""
    source = initial_hf(init_from, depth)
    if not source:
        return None
    try:
        return json.loads((hf_dir(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None


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
        default = default_max_seq_len(hf)  # (none given: the window where it binds, not max_position_embeddings)
        fields = model_fields_from_hf(hf, str(where), values.get("max_seq_len") or default)
        fields["max_seq_len"] = default
        preset = "hf"

        def stored(key):
            family, name = hf.get("model_type"), _hf_key(key, hf.get("model_type"), hf)
            # (a key the file leaves out is its family's default in transformers, not None: with_family_defaults)
            config_class = FAMILIES[family].replace("ForCausalLM", "Config")
            said = (f"config.json has {name}={hf[name]!r}" if name in hf else
                    f"config.json has no {name} (transformers' {config_class} default applies)")
            if key == "moe.dense_layers" and "decoder_sparse_step" in hf:
                said += f" and decoder_sparse_step={hf['decoder_sparse_step']!r}"
            return said
    else:
        path, model = _checkpoint_model(source)
        where = path / "manifest.json"
        preset = model.get("preset", "debug")
        # a key the manifest lacks was written before longctx had it: the weights have its default
        fields = {k: v for k, v in {**model_defaults(), **model}.items() if k not in ("preset", "init_from")}

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
        if key in EXTENSION_KEYS or key in TRAINING_KEYS:
            if fields.get(key) != value:
                changed.append(f"model.{key}: {fields.get(key)!r} -> {value!r}")
            fields[key] = value
        elif key in fields and fields[key] != value and not (isinstance(value, (int, float)) and
                                                             not isinstance(value, bool) and
                                                             float(fields[key]) == float(value)):
            raise HFFormatError(
                f"model.{key}={value!r} contradicts the weights in {path}: {stored(key)}, so model.{key} must be "
                f"{fields[key]!r}. Drop the override; only context-extension keys "
                f"({', '.join(sorted(EXTENSION_KEYS))}) and training keys ({', '.join(sorted(TRAINING_KEYS))}) "
                f"may differ from the weights.")
    if source.startswith("hf:"):  # (after the contradictions: a key the user set is said first)
        check_heads(hf, str(where))
    elif (origin := initial_hf_config(source)) is not None:  # (a window binds every run started from the weights)
        check_sliding_window(origin, f"model.init_from = {source!r} started from weights whose config.json says",
                             fields["max_seq_len"])
    fields.update(preset=preset, init_from=source)
    return fields, changed

