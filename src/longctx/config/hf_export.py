"""A [model] written as its Hugging Face family's config.json (`longctx checkpoint export`): the
inverse of config/hf.py's reading, and the check of what a family cannot express."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .hf import FAMILIES, HFFormatError
from .hf_rope import linear_positions
from .layer_lists import parse_layer_list
from .positions import scaled_reach
from .schema import MOE_FAMILIES

# the model.rope_* settings each model.rope_scaling reads (beside theta; models/llama.py), each with the name
# config.json's rope_scaling gives it; eval's result records the same (eval/results.py rope_record)
ROPE_SCALING_READS: dict[str, dict[str, str]] = {
    "none": {}, "linear": {"factor": "factor"},
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "original_max_len": "original_max_position_embeddings"},
    "yarn": {"factor": "factor", "original_max_len": "original_max_position_embeddings", "beta_fast": "beta_fast",
             "beta_slow": "beta_slow", "truncate": "truncate", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
             "attention_factor": "attention_factor"},
}
_ZERO_IS_UNSET = ("mscale", "mscale_all_dim", "attention_factor")  # (yarn's: written only when set)


def export_problems(m) -> list[str]:
    """Why the [model] `m` (a ModelConfig) cannot be written as its family's config.json: what
    transformers' class for that family cannot express (empty when it can)."""
    f = m.family
    if f in ("mistral", "mixtral") and (m.qkv_bias or m.out_bias):
        return [f"transformers' {f} has no attention biases (it would drop the model's): export as llama, or train "
                f"with model.qkv_bias and model.out_bias false."]
    if not m.is_moe:
        return [f"model.family={f} is a Mixture-of-Experts family; a dense model exports as llama, mistral, qwen2 "
                f"or qwen3."] if f in MOE_FAMILIES else []
    if f not in MOE_FAMILIES:
        return [f"a Mixture-of-Experts model (model.moe.experts={m.moe_experts}) exports as one of "
                f"{', '.join(MOE_FAMILIES)}, not model.family={f}."]
    problems = []
    if m.moe_router == "switch" and f == "mixtral":
        problems.append("mixtral renormalises its top-1 weight to 1; the switch router weighs the chosen expert by "
                        "its probability (Qwen2-MoE, Qwen3-MoE and OLMoE export it, as norm_topk_prob false).")
    elif m.moe_router not in ("softmax", "switch"):
        problems.append(f"{f} routes by the top-k of a softmax; model.moe.router={m.moe_router} has no "
                        f"transformers equivalent.")
    if m.moe_route_scale != 1.0:
        problems.append(f"{f} has no factor on the routing weights (model.moe.route_scale={m.moe_route_scale}).")
    if f == "mixtral" and not m.moe_norm_topk:
        problems.append("mixtral always renormalises the top-k weights (model.moe.norm_topk must be true).")
    shared, dense = m.resolved_shared_dim, parse_layer_list(m.moe_dense_layers) & set(range(m.layers))
    # (a qwen2_moe of shared_expert_intermediate_size 0 has none: its 0-wide shared expert adds nothing)
    if f == "qwen2_moe" and shared and not m.moe_shared_gate:
        problems.append("qwen2_moe gates its shared expert (a sigmoid of the input), and no family has an ungated "
                        "one: train with model.moe.shared_gate=true, or without shared experts (then qwen3_moe too).")
    if f != "qwen2_moe" and shared:
        problems.append(f"{f} has no shared experts (model.moe.shared_dim={shared}); qwen2_moe has one.")
    if f in ("mixtral", "olmoe") and dense:
        problems.append(f"{f} has experts in every layer; model.moe.dense_layers={m.moe_dense_layers!r} needs "
                        f"qwen2_moe or qwen3_moe.")
    if f == "olmoe" and m.resolved_head_dim * m.heads != m.dim:  # (its q/k norms are hidden_size wide)
        problems.append(f"olmoe's q/k norms span hidden_size, so its heads are dim / heads wide: model.head_dim="
                        f"{m.resolved_head_dim} x {m.heads} heads is not model.dim={m.dim} (train with "
                        f"model.head_dim 0).")
    if f in ("mixtral", "olmoe") and m.resolved_expert_dim != m.ffn_dim:
        problems.append(f"{f} has one intermediate_size, the experts' width: set model.ffn_dim to "
                        f"model.moe.expert_dim ({m.resolved_expert_dim}).")
    return problems


def check_exportable(m) -> None:
    """Refuse the [model] `m` when its family's config.json cannot express it (export_problems): what
    `longctx checkpoint export` checks before it reads a weight, and save_hf before it writes one."""
    problems = export_problems(m)
    if problems:
        raise HFFormatError(f"this model cannot be written as a Hugging Face {m.family}: {' '.join(problems)}")


def export_notes(m, trained: int = 0) -> list[str]:
    """What an export writes differently from how the model trained (the weights are exact; a training
    objective transformers cannot state is left off, and said). `trained`: as for hf_config_from_model."""
    notes = []
    written = _max_positions(m, trained)
    if m.rope_scaling == "yarn" and written != m.rope_original_max_len * m.rope_factor:
        notes.append(f"max_position_embeddings is the run's length {written}, not yarn's original x factor "
                     f"({m.rope_original_max_len} x {m.rope_factor:g}): transformers before 4.56 derive yarn's factor "
                     f"from their ratio and would rotate positions otherwise; read the export with 4.56 or later")
    linear = m.rope_scaling == "linear"
    reach = scaled_reach(m)
    if trained and reach > trained:
        # (no config.json key can say less: vLLM and longctx's hf: reader count a yarn model's reach as original x
        # factor whatever max_position_embeddings says, and writing the record there broke transformers < 4.56)
        notes.append(f"readers of a yarn config.json (vLLM, longctx's hf: reader) trust the export with original x "
                     f"factor = {reach} positions ({m.rope_original_max_len} x {m.rope_factor:g}; "
                     f"max_position_embeddings is {written}), past the {trained} the weights trained on (the "
                     f"checkpoint's trained_positions, all longctx trusts the checkpoint with): keep prompts within "
                     f"{trained}, or train on longer sequences before exporting")
    elif trained and written * (m.rope_factor if linear else 1) < m.max_seq_len:
        times = f" (x the linear factor {m.rope_factor:g})" if linear else ""
        notes.append(f"max_position_embeddings is {written}{times}: the {trained} positions the weights trained "
                     f"on (the checkpoint's trained_positions), not model.max_seq_len {m.max_seq_len}, which no "
                     f"sequence reached; readers take it as the length the model serves")
    if not m.is_moe:
        return notes
    if m.moe_aux_loss and m.moe_aux_loss_scope != "pooled":
        notes.append(f"the run's balancing loss (model.moe.aux_loss_scope={m.moe_aux_loss_scope}, aux_loss="
                     f"{m.moe_aux_loss}) has no config.json equivalent: transformers pools every layer's routing "
                     f"into one loss; config.json says output_router_logits=false (transformers adds no balancing "
                     f"loss), and router_aux_loss_coef={m.moe_aux_loss} applies, pooled, to whoever sets it true")
    if m.moe_z_loss:
        notes.append(f"the run's router z-loss (model.moe.z_loss={m.moe_z_loss}) is written as router_z_loss_coef, "
                     f"which longctx reads back and transformers' {m.family} never reads: training the export with "
                     f"transformers adds no z-loss")
    return notes


def _norm_topk(m) -> bool:
    """config.json's norm_topk_prob: the switch router (top-1 of a softmax) weighs by the probability whatever
    moe.norm_topk says, which is the softmax top-1 without renormalisation."""
    return m.moe_norm_topk and m.moe_router != "switch"


def _router_losses_on(m) -> bool:
    """config.json's output_router_logits: on exactly when the model trained with the balancing loss
    transformers computes (pooled; a z-loss alone is nothing transformers adds)."""
    return bool(m.moe_aux_loss and m.moe_aux_loss_scope == "pooled")


def _max_positions(m, trained: int = 0) -> int:
    """config.json's max_position_embeddings: the positions the weights can be trusted with, as readers count
    them. `trained` is a checkpoint's recorded trained_positions (config/positions.py; 0: unknown, the run's
    max_seq_len instead, as save_hf of a model writes it): max_seq_len is a number the user may raise at will
    (the presets' 131,072), and transformers' users, vLLM and longctx's own hf: reader take this key as the
    length the model serves, so a debug run trained on 512 must not say 131,072. For yarn, original x factor
    when that is longer: transformers before 4.56 (huggingface/transformers#38224, fixed by #40320) took
    yarn's factor as max_position_embeddings / original whenever the original is given, so only that length
    makes every reader rotate as the run did; it is the reach longctx (and vLLM) counts for such a scaling
    anyway. For linear, the length before the factor: a linear config.json gives that (vicuna-7b-v1.5-16k:
    4,096 x 4), as transformers' docs, vLLM and config/positions.py read it; the scaled length written there
    read back as reaching factor times further than the weights trained."""
    length = trained or m.max_seq_len
    if m.rope_scaling == "yarn" and m.rope_original_max_len:
        scaled = m.rope_original_max_len * m.rope_factor
        if scaled >= length and float(scaled).is_integer():
            return int(scaled)
    if m.rope_scaling == "linear":  # (a reach read back never past the trained one, and no shorter)
        return linear_positions(length, m.rope_factor)
    return length


def hf_config_from_model(m, dtype_name: str = "float32", trained: int = 0) -> dict:
    """config.json for the [model] `m` (a ModelConfig) whose weights trained on `trained` positions (a
    checkpoint's trained_positions; 0: not known, _max_positions). RoPE is written once, in the classic form
    (rope_theta + rope_scaling): transformers 4 reads only that, transformers 5 reads it as rope_parameters
    (and saves rope_parameters alone); a file with both means whichever rope_scaling says, so a
    rope_scaling added later (Qwen's model cards' YaRN) must not sit beside a stale rope_parameters."""
    rope: dict[str, Any] = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling}
    for ours, theirs in ROPE_SCALING_READS[m.rope_scaling].items():
        value = getattr(m, f"rope_{ours}")
        if value or ours not in _ZERO_IS_UNSET:
            rope[theirs] = value
    check_exportable(m)
    out = {
        "architectures": [FAMILIES[m.family]], "model_type": m.family,
        "hidden_size": m.dim, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.resolved_head_dim, "intermediate_size": m.ffn_dim,
        "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": _max_positions(m, trained), "initializer_range": m.init_std, "hidden_act": "silu",
        # (null, not left out, for none: OLMoE's class reads a missing one as 1 and would stop that row's gradient)
        "pad_token_id": m.padding_idx if m.padding_idx >= 0 else None,
        "rope_theta": m.rope_theta, "rope_scaling": None if m.rope_scaling == "none" else rope,
        "torch_dtype": dtype_name, "dtype": dtype_name,
    }
    if m.family == "qwen2_moe":
        out["qkv_bias"] = m.qkv_bias
    elif m.family not in ("qwen2", "mistral", "mixtral"):  # (those two have no biases and no such key)
        out["attention_bias"] = m.qkv_bias
    if m.family == "llama":
        out["mlp_bias"] = False
    if m.family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    if m.family in ("mistral", "mixtral"):
        out["sliding_window"] = None
    if m.is_moe:
        # the router losses as config.json says them (config/hf.py reads them back): on only when asked
        out.update(num_experts_per_tok=m.moe_top_k, router_aux_loss_coef=m.moe_aux_loss,
                   output_router_logits=_router_losses_on(m))
        if m.moe_z_loss:
            out["router_z_loss_coef"] = m.moe_z_loss
    if m.family == "mixtral":
        out.update(num_local_experts=m.moe_experts, intermediate_size=m.resolved_expert_dim, router_jitter_noise=0.0)
    elif m.family == "olmoe":
        out.update(num_experts=m.moe_experts, intermediate_size=m.resolved_expert_dim, norm_topk_prob=_norm_topk(m),
                   clip_qkv=None)
    elif m.family in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=m.moe_experts, moe_intermediate_size=m.resolved_expert_dim,
                   norm_topk_prob=_norm_topk(m), decoder_sparse_step=1,
                   mlp_only_layers=sorted(parse_layer_list(m.moe_dense_layers) & set(range(m.layers))))
        if m.family == "qwen2_moe":
            out["shared_expert_intermediate_size"] = m.resolved_shared_dim
    return out


# config.json's special token ids: transformers' classes default the missing ones (LlamaConfig: BOS 1,
# EOS 2), so an export of a run from scratch writes all three, null where the tokenizer has none; one that
# started from a Hugging Face model writes those its config.json names (the others read as they read there)
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def declared_special_ids(tokenizer_json: Path) -> dict[str, int]:
    """The special tokens a tokenizer.json's own tokenizer_config.json (beside it) declares
    (bos_token, eos_token, pad_token: a string or {"content": ...}), as config.json keys with the
    tokenizer.json's ids; only those it declares and the vocabulary holds."""
    config_file = Path(tokenizer_json).parent / "tokenizer_config.json"
    try:
        declared = json.loads(config_file.read_text())
        tok = json.loads(Path(tokenizer_json).read_text())
    except (OSError, ValueError):
        return {}
    vocab = tok.get("model", {}).get("vocab") or {}
    if isinstance(vocab, list):  # (Unigram: [piece, score] pairs, the id is the position)
        vocab = {piece: i for i, (piece, *_) in enumerate(vocab)}
    vocab = {**vocab, **{t["content"]: t["id"] for t in tok.get("added_tokens", [])}}
    ids = {}
    for name in ("bos", "eos", "pad"):
        token = declared.get(f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token in vocab:
            ids[f"{name}_token_id"] = vocab[token]
    return ids
