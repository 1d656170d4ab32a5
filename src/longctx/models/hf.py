"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) <-> our model.

`load_hf(path)` reads a local directory (config.json + model.safetensors, or shards listed in
model.safetensors.index.json) into a new single-process model. `load_hf_weights(model, path)` fills
an existing model that may already be sharded by FSDP: each rank reads, from the memory-mapped
safetensors files, only the rows of each tensor it owns (`safe_open(...).get_slice`), so no rank
ever holds the whole checkpoint. `save_hf(model, path)` writes the same family's config.json and
safetensors (sharded above a size, with an index) that transformers loads.

config.json is translated by config/hf.py (both RoPE forms, every supported RoPE type). Our RoPE
uses the same "rotate half" layout as Hugging Face, so q/k weights map one to one.

Routed experts are read from either layout transformers writes: one tensor per expert and
projection (`mlp.experts.E.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.E.w1.weight`:
the published checkpoints, and what save_pretrained writes by default), or transformers 5's fused
3D tensors (`mlp.experts.gate_up_proj` [E, 2 x hidden, dim] = gate and up stacked on dim 1,
`mlp.experts.down_proj` [E, dim, hidden]). Our w1 (gate) and w3 (up) are [E, hidden, dim], w2
(down) [E, dim, hidden], so either maps row for row; a rank holding some experts' rows reads those.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..config.hf import HFFormatError, model_config, model_fields_from_hf, read_hf_config
from ..config.hf_export import hf_config_from_model
from ..config.hf_families import check_heads
from ..progress import phase, say
from .hf_files import open_safetensors, weight_files
from .llama import Llama, build_model
from .moe import moe_layers
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
# a MoE layer's router and shared expert (our name within layer i -> within model.layers.i); the routed
# experts are `_sources`' (per expert, or fused)
_MOE_MAP = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
# one expert's projections: our w1 (gate), w3 (up), w2 (down) in Qwen-MoE / OLMoE and in Mixtral
_EXPERT_NAMES = {"w1": "gate_proj.weight", "w3": "up_proj.weight", "w2": "down_proj.weight"}
_MIXTRAL_EXPERT_NAMES = {"w1": "w1.weight", "w3": "w3.weight", "w2": "w2.weight"}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# files a Hugging Face tokenizer may consist of; copied next to exported weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def hf_name(ours: str) -> str:
    """The Hugging Face name of one of our tensors (not the routed experts: `_sources`)."""
    if ours in _TOP_MAP:
        return _TOP_MAP[ours]
    _, i, rest = ours.split(".", 2)
    return f"model.layers.{i}.{_LAYER_MAP.get(rest) or _MOE_MAP[rest]}"


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A parsed Hugging Face config.json -> our ModelConfig."""
    return model_config({**model_fields_from_hf(hf, where), "preset": "hf"})


@dataclass
class _Source:
    """Where one of our parameters is stored: `whole` (one tensor of the same shape), `stack` (one
    tensor per expert, names[e] holding row e of our [E, ...] tensor), or `fused` (rows
    offset : offset + n of dim 1 of one [E, 2n, ...] tensor: transformers 5's gate_up_proj)."""
    kind: str
    names: list[str]
    offset: int = 0


def _sources(model: Llama, files: dict[str, Path]) -> dict[str, _Source]:
    """Our parameter names -> where each is stored, for the expert layout the files use (per
    expert, as transformers 4 and save_pretrained write; or fused, transformers 5's own)."""
    # layers whose MoE block is Mixtral's older `block_sparse_moe` (else `mlp`: transformers 5, Qwen, OLMoE)
    old_mixtral = {name.split(".")[2] for name in files if ".block_sparse_moe." in name}
    out = {}
    for ours, p in model.named_parameters():
        _, i, rest = ours.split(".", 2) if ours.startswith("layers.") else ("", "", ours)
        if rest.startswith("feed_forward.router.") or rest.startswith("feed_forward.experts."):
            prefix = f"model.layers.{i}.{'block_sparse_moe' if i in old_mixtral else 'mlp'}"
            if rest == "feed_forward.router.gate.weight":
                out[ours] = _Source("whole", [f"{prefix}.gate.weight"])
                continue
            which = rest.rsplit(".", 1)[1]  # w1, w2 or w3
            fused = f"{prefix}.experts.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
            if fused in files:
                out[ours] = _Source("fused", [fused], p.shape[1] if which == "w3" else 0) if which != "w2" \
                    else _Source("whole", [fused])
                continue
            names = _EXPERT_NAMES if f"{prefix}.experts.0.{_EXPERT_NAMES['w1']}" in files else _MIXTRAL_EXPERT_NAMES
            out[ours] = _Source("stack", [f"{prefix}.experts.{e}.{names[which]}" for e in range(p.shape[0])])
            extra = f"{prefix}.experts.{p.shape[0]}.{names[which]}"
            if extra in files:
                raise HFFormatError(f"{files[extra].parent} holds {extra}: more experts than config.json's "
                                    f"{p.shape[0]}; the weights and config.json disagree.")
        else:
            # (a tied model whose shared tensor is stored under lm_head.weight alone, as safetensors' save_model
            # keeps it: transformers ties symmetrically when it loads, so that head is the embedding)
            head_only = ours == "tok_embeddings.weight" and model.output is None and hf_name(ours) not in files
            out[ours] = _Source("whole", ["lm_head.weight" if head_only and "lm_head.weight" in files
                                          else hf_name(ours)])
    return out


def _check_shape(src: _Source, stored: tuple, p: torch.Tensor, name: str, file: Path) -> None:
    want = tuple(p.shape)
    if src.kind == "stack":
        want = want[1:]
    elif src.kind == "fused":
        want = (want[0], 2 * want[1], *want[2:])
    if stored != want:
        raise HFFormatError(f"{file.name}: tensor {name} has shape {stored}, config.json implies {want}.")


def _check_dtype(dtype: str, name: str, file: Path) -> None:
    """Refuse a tensor stored quantized (float8, or integers packing several weights): cast as it is, it would
    be another model's weights (its scales are other tensors)."""
    if dtype.startswith("F8") or dtype in ("I8", "U8", "I16", "I32", "I64", "U16", "U32", "U64"):
        raise HFFormatError(f"{file.name}: tensor {name} is stored as {dtype}, a quantized weight; longctx reads "
                            f"unquantized (float) weights only. Use the model's bf16 release, or dequantize it once.")


def _check_tied(embed, head, path: Path, rows: int = 4096) -> None:
    """config.json ties the head to the embedding, but the files hold an lm_head.weight too: it must be the
    embedding (compared a block of rows at a time). transformers 5 unties a model whose two differ and uses
    the file's head (4.x ties it and drops the head): which is meant is the config's to say, not ours."""
    vocab = embed.get_shape()[0]
    for lo in range(0, vocab, rows):
        hi = min(vocab, lo + rows)
        if not torch.equal(embed[lo:hi], head[lo:hi]):
            raise HFFormatError(f"{path}/config.json has tie_word_embeddings true, but the files hold an "
                                f"lm_head.weight that differs from model.embed_tokens.weight (rows {lo}-{hi - 1}): "
                                f"transformers 5 unties such a model and uses the head, 4.x ties it and drops it. "
                                f"Set tie_word_embeddings to false in config.json to use the head (as transformers 5), "
                                f"or remove lm_head.weight to tie them.")


def _check_unused(model: Llama, files: dict[str, Path], sources: dict[str, _Source], tensor, path: Path) -> None:
    """Refuse tensors the files hold that config.json gives no place (attention biases beside attention_bias
    false, q/k norms under a model_type without them), as a tensor config.json implies and the files lack is
    refused: left out, the model computes another function than the weights' (transformers loads it too, listing
    them as weights not used). Not the model's computation: RoPE's inv_freq buffers, tensors that are empty or all
    zeros (a zero bias adds nothing), a Qwen2-MoE's shared expert of width 0 with its gate (which gates nothing),
    and whole layers past config.json's num_hidden_layers (a model cut to its first layers, an MTP layer: the
    model config.json describes is computed exactly, as transformers computes it; those are not read at all)."""
    used = {name for src in sources.values() for name in src.names} | {"lm_head.weight"}  # (tied: _check_tied)
    # (without a shared expert, its gate gates nothing; the expert's own tensors are checked like any other: 0 wide,
    # they are empty, but a shared expert of real width beside such a config.json is the weights' and is refused)
    no_shared = ".mlp.shared_expert_gate." if model.cfg.family == "qwen2_moe" and not model.cfg.resolved_shared_dim \
        else None
    _note_past_layers(files, model.cfg.layers, path)
    extra = []
    for name in sorted(n for n in files if n not in used and not n.endswith(".rotary_emb.inv_freq")
                       and not (no_shared and no_shared in n) and not _past_last_layer(n, model.cfg.layers)):
        if _nonzero(tensor(name)[0]):
            extra.append(name)
    if extra:
        raise HFFormatError(f"{path} holds {len(extra)} tensors that config.json gives no place, e.g. "
                            f"{', '.join(extra[:3])}: left out, the model would compute another function than the "
                            f"weights' (transformers lists them as weights not used). The weights and config.json "
                            f"disagree: set the key that reads them (attention_bias true for attention biases, the "
                            f"weights' own model_type, e.g. qwen3 for q_norm / k_norm), or remove them from the files "
                            f"if they are not the model's.")


def _past_last_layer(name: str, layers: int) -> bool:
    """`name` is a tensor of model.layers.i with i past config.json's num_hidden_layers."""
    parts = name.split(".", 3)
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers


def _note_past_layers(files: dict[str, Path], layers: int, path: Path) -> None:
    """Say (rank 0) which layers past num_hidden_layers the files hold, left unread: a config.json that is wrong
    (the files' layers are all the model's) otherwise loaded a shorter model without a word, where transformers
    lists them as weights not used."""
    past = sorted({int(n.split(".", 3)[2]) for n in files if _past_last_layer(n, layers)})
    if past and os.environ.get("RANK", "0") in ("", "0"):
        run = past == list(range(past[0], past[-1] + 1))
        held = f"layer {past[0]}" if len(past) == 1 else \
            f"layers {past[0]}-{past[-1]}" if run else f"layers {', '.join(map(str, past))}"
        say(f"note: {path} holds {held} past config.json's num_hidden_layers = {layers}, not loaded: the model "
            f"computed is config.json's {layers} layers, as transformers computes it (right for a model cut to its "
            f"first layers or an MTP layer). If the files' layers are all the model's, set num_hidden_layers to "
            f"{past[-1] + 1} in config.json.")


def _nonzero(stored, rows: int = 4096) -> bool:
    """Whether a stored tensor (a safetensors slice) holds a non-zero value, read a block of rows at a time and
    stopped at the first non-zero block: not the whole tensor at once on every rank."""
    shape = stored.get_shape()
    if 0 in shape:
        return False
    if not shape:  # (a 0-dim tensor)
        return bool(stored[...].any())
    return any(stored[lo:lo + rows].any() for lo in range(0, shape[0], rows))


_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _missing_error(model: Llama, files: dict[str, Path], missing: list[str], path: Path) -> HFFormatError:
    """The tensors config.json implies that the files lack, said as what it is when the files are a Mixture of
    Experts read as a dense family (model_type qwen2 for a Qwen2-MoE, llama or mistral for a Mixtral): then the
    config.json key that counts the experts (which the dense family ignores, as transformers' class does) and the
    MoE families, not only the dense MLP tensors the files lack."""
    said = f"{path} lacks {len(missing)} tensors that config.json implies, e.g. {', '.join(missing[:3])}"
    experts = next((n for n in sorted(files) if ".experts." in n), None)
    if model.cfg.is_moe or experts is None:
        return HFFormatError(f"{said}; the weights and config.json disagree.")
    hf = read_hf_config(path)  # (read already to build the model: valid here)
    count = next((f"{k}={hf[k]}" for k in _EXPERT_COUNT_KEYS if hf.get(k)), None)
    keys = f" and config.json says {count}" if count else ""
    return HFFormatError(
        f"{said}: the files hold a Mixture of Experts (e.g. {experts}){keys}, but config.json's model_type "
        f"'{model.cfg.family}' is a dense family, which has no experts (transformers' {model.cfg.family} class "
        f"ignores the expert keys too). Set model_type to the weights' Mixture-of-Experts family (mixtral, "
        f"qwen2_moe, qwen3_moe or olmoe, the ones longctx reads), with its expert keys.")


def _with_model_prefix(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """(files by the causal LM's names, {that name: the name stored} where they differ). A base model's checkpoint
    (saved from AutoModel, as embedding models ship: `embed_tokens.weight`, `layers.0. ...`, no `model.` prefix)
    is read as transformers' AutoModelForCausalLM reads it, with the prefix added (its head: the tied embedding;
    an untied one is missing and refused, where transformers would draw it at random)."""
    if "model.embed_tokens.weight" in files or "embed_tokens.weight" not in files:
        return files, {}
    renamed = {name if name.startswith(("model.", "lm_head.")) else f"model.{name}": name for name in files}
    return {new: files[old] for new, old in renamed.items()}, {new: old for new, old in renamed.items() if new != old}


@torch.no_grad()
def load_hf_weights(model: Llama, path: str | Path) -> None:
    """Fill `model` (materialised, possibly FSDP-sharded) from the safetensors in `path`, each rank
    reading only the part of every tensor it holds (for experts: only its experts' rows, from
    either expert layout). Reading a large model takes minutes: it runs as a progress phase that
    counts the MB this rank has filled."""
    path = Path(path)
    files, stored_as = _with_model_prefix(weight_files(path))
    params = dict(model.named_parameters())
    sources = _sources(model, files)
    missing = [name for src in sources.values() for name in src.names if name not in files]
    if missing:
        raise _missing_error(model, files, missing, path)
    with ExitStack() as stack:
        opened: dict[Path, object] = {}

        def tensor(name):
            file = files[name]
            if file not in opened:
                opened[file] = stack.enter_context(open_safetensors(file))
            return opened[file].get_slice(stored_as.get(name, name)), file

        for ours, src in sources.items():  # every shape first: a mismatch is refused before anything is read
            for name in src.names:
                stored, file = tensor(name)
                _check_shape(src, tuple(stored.get_shape()), params[ours], name, file)
                _check_dtype(stored.get_dtype(), name, file)
        if model.output is None and "lm_head.weight" in files and "model.embed_tokens.weight" in files:
            _check_tied(tensor("model.embed_tokens.weight")[0], tensor("lm_head.weight")[0], path)
        _check_unused(model, files, sources, tensor, path)
        mb = {ours: local_part(params[ours]).nbytes / 1e6 for ours in sources}
        with phase(f"loading the weights of {path}", total=sum(mb.values()), unit="MB") as progress:
            for ours, src in sources.items():
                p = params[ours]
                local, index = local_part(p), local_slices(p)
                if src.kind == "whole":
                    local.copy_(tensor(src.names[0])[0][index].to(local.dtype))
                elif src.kind == "fused":
                    rows = slice(index[1].start + src.offset, index[1].stop + src.offset)
                    local.copy_(tensor(src.names[0])[0][(index[0], rows, *index[2:])].to(local.dtype))
                else:
                    for row, e in enumerate(range(index[0].start, index[0].stop)):
                        local[row].copy_(tensor(src.names[e])[0][index[1:]].to(local.dtype))
                progress.update(mb[ours])
    for layer in moe_layers(model):  # transformers' routers have no selection bias
        layer.router.expert_bias.zero_()
    model.init_rope()


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Llama:
    """Read a local Hugging Face directory into a new single-process model."""
    path = Path(path)
    hf = read_hf_config(path)
    cfg = config_from_hf(hf, str(path / "config.json"))
    check_heads(hf, str(path / "config.json"))  # (a run's reader checks it after the keys the user set)
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    load_hf_weights(model, path)
    if dtype != torch.float32:
        model.to(dtype)
        model.init_rope()  # RoPE frequencies stay fp32
    return model


def copy_tokenizer_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copy the tokenizer files found in `source` (a Hugging Face directory, or a tokenizer.json file
    with the files beside it that declare its special tokens: the ids config.json takes from them,
    hf_export.declared_special_ids; and its chat_template.jinja, which `longctx generate --chat` renders
    a prompt to the run's checkpoints with: left behind, the export had no template, data/chat_template.py)
    into `dest`; the names copied. A tokenizer file of another name (my_tok.json) is copied as tokenizer.json,
    the name AutoTokenizer.from_pretrained looks for, and said so: "tokenizer.json (from my_tok.json)"."""
    source = Path(source)
    if source.is_file():
        beside = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
        candidates = [(source, "tokenizer.json")] + [(source.parent / name, name) for name in beside]
    else:
        candidates = [(source / name, name) for name in TOKENIZER_FILES]
    copied = []
    for file, name in candidates:
        if file.is_file():
            shutil.copyfile(file, Path(dest) / name)
            copied.append(name if file.name == name else f"{name} (from {file.name})")
    return copied


def _hf_state(model: Llama, dtype: torch.dtype | None, fused_experts: bool) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face names: routed experts one tensor per expert and projection
    (transformers 4's names, what save_pretrained writes by default) or fused (transformers 5's)."""
    state, ours = {}, model.state_dict()
    for k, v in ours.items():
        v = v.detach().to(dtype or v.dtype).cpu()
        if k.endswith("router.expert_bias"):
            if v.any():
                raise HFFormatError(f"{k} is not zero (aux-loss-free balancing, model.moe.bias_update_rate): "
                                    f"transformers' routers have no selection bias, so the export would route "
                                    f"differently from this model.")
            continue
        if ".feed_forward.experts." not in k:
            state[hf_name(k)] = v.contiguous()
            continue
        layer, which = int(k.split(".")[1]), k.rsplit(".", 1)[1]
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if model.cfg.family == 'mixtral' else 'mlp'}"
        if fused_experts:
            prefix = f"model.layers.{layer}.mlp"
            if which == "w2":
                state[f"{prefix}.experts.down_proj"] = v.contiguous()
            elif which == "w1":  # gate_up_proj = [gate; up] on dim 1
                up = ours[k[:-2] + "w3"].detach().to(v.dtype).cpu()
                state[f"{prefix}.experts.gate_up_proj"] = torch.cat([v, up], dim=1).contiguous()
            continue
        names = _MIXTRAL_EXPERT_NAMES if model.cfg.family == "mixtral" else _EXPERT_NAMES
        for e in range(v.shape[0]):
            state[f"{prefix}.experts.{e}.{names[which]}"] = v[e].contiguous()
    if model.cfg.family == "mixtral" and not fused_experts:  # the router where transformers 4 has it
        state = {n.replace(".mlp.gate.", ".block_sparse_moe.gate."): t for n, t in state.items()}
    if model.cfg.family == "qwen2_moe" and not model.cfg.resolved_shared_dim:
        state.update(_empty_shared_experts(model, next(iter(state.values())).dtype))
    return state


def _empty_shared_experts(model: Llama, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Qwen2-MoE without shared experts (shared_expert_intermediate_size 0, which transformers builds as a
    0-wide MLP behind a gate: it adds exactly nothing): its 0-wide projections and a zero gate, so that
    transformers finds every weight it builds rather than initialising the missing ones at random."""
    d, state = model.cfg.dim, {}
    for i in model.cfg.moe_layer_ids:
        mlp = f"model.layers.{i}.mlp"
        state.update({f"{mlp}.shared_expert.gate_proj.weight": torch.zeros(0, d, dtype=dtype),
                      f"{mlp}.shared_expert.up_proj.weight": torch.zeros(0, d, dtype=dtype),
                      f"{mlp}.shared_expert.down_proj.weight": torch.zeros(d, 0, dtype=dtype),
                      f"{mlp}.shared_expert_gate.weight": torch.zeros(1, d, dtype=dtype)})
    return state


def save_hf(model: Llama, path: str | Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
            tokenizer_from: str | Path | None = None, fused_experts: bool = False, trained_positions: int = 0) -> Path:
    """Write config.json and safetensors weights (sharded above `max_shard_bytes`, with an index),
    in `dtype` (default: the model's), plus the tokenizer files of `tokenizer_from` if given.
    A Mixture of Experts is written as its family (transformers' MixtralForCausalLM, ...) with one
    tensor per expert and projection, the layout of the published checkpoints that every version
    of transformers reads; `fused_experts=True` writes transformers 5's own 3D tensors instead.
    `trained_positions`: the positions the weights trained on, when known (a checkpoint's record), which
    config.json's max_position_embeddings then says (config/hf_export.py _max_positions)."""
    path = Path(path)
    state = _hf_state(model, dtype, fused_experts)
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = hf_config_from_model(model.cfg, dtype_name, trained_positions)  # (refuses what a family cannot say)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
