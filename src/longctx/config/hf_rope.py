"""A config.json's RoPE as transformers reads it -> the [model] rope fields.

Two forms exist: the classic `rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`
(rope_theta inside). transformers 5 keeps the classic form working by letting rope_scaling replace
rope_parameters whole (`rope_parameters = rope_scaling or rope_parameters`; theta then from
rope_scaling, else the top-level rope_theta, else the class default), and transformers 4 reads
rope_scaling only. A file that carries both and means two different things (a YaRN rope_scaling
added, as Qwen's model cards say, to a config.json saved with rope_parameters) is refused rather
than read one way: training on one reading and serving on the other is the silent error.
"""

from __future__ import annotations

import json
from typing import Any

from .hf_families import FAMILY_DEFAULTS, HFFormatError, with_family_defaults

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _kind(p: dict) -> str:
    return p.get("rope_type", p.get("type", "default"))


def _settings(p: dict, hf: dict) -> dict:
    """A rope dict as transformers completes it, without its theta (what two dicts must agree on)."""
    out = {**{k: v for k, v in p.items() if k not in ("rope_theta", "type")}, "rope_type": _kind(p)}
    if out["rope_type"] in ("llama3", "yarn"):  # (a top-level original_max_position_embeddings wins)
        out["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings") or
                                                   out.get("original_max_position_embeddings") or
                                                   hf.get("max_position_embeddings"))
    return out


def rope_params(hf: dict, where: str) -> tuple[str, dict]:
    """(rope type, its parameters with rope_theta) from either config.json form, as transformers reads it."""
    hf = with_family_defaults(hf)
    rope, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        kinds = sorted(rope)
        raise HFFormatError(f"{where}: rope_parameters is nested per layer type ({', '.join(kinds)}); longctx "
                            f"reads one RoPE setting for every layer.")
    params = dict(scaling or rope or {})
    params.setdefault("rope_theta", hf["rope_theta"])
    if scaling and rope:
        theta = rope.get("rope_theta", params["rope_theta"])
        if _settings(scaling, hf) != _settings(rope, hf) or float(theta) != float(params["rope_theta"]):
            raise HFFormatError(
                f"{where}: rope_scaling={scaling} and rope_parameters={rope}, which say different "
                f"things (as transformers reads rope_scaling: {_settings(scaling, hf)} with rope_theta="
                f"{params['rope_theta']}). transformers reads rope_scaling and ignores rope_parameters (4.x knows "
                f"only rope_scaling; 5.x lets it replace rope_parameters whole, theta from rope_scaling, the "
                f"top-level rope_theta or the class default); longctx will not pick one silently. Keep one key: "
                f"delete rope_parameters (with rope_theta beside rope_scaling) for the rope_scaling setting, or "
                f"delete rope_scaling for rope_parameters.")
    kind = _kind(params)
    if kind not in ROPE_TYPES:
        raise HFFormatError(f"{where}: RoPE type '{kind}' is not supported; longctx reads {', '.join(ROPE_TYPES)}. "
                            f"Convert the checkpoint or pick a model that uses one of these.")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFFormatError(f"{where}: partial_rotary_factor={partial}; longctx rotates the whole head.")
    return kind, params


def rope_fields(hf: dict, where: str) -> dict[str, Any]:
    """The [model] rope keys of config.json `hf`."""
    kind, p = rope_params(hf, where)
    hf = with_family_defaults(hf)
    if isinstance(p["rope_theta"], bool) or not isinstance(p["rope_theta"], (int, float)):
        raise HFFormatError(f"{where}: rope_theta is {json.dumps(p['rope_theta'])}, not a number; set it to the "
                            f"value the weights were trained with, or remove the key for the {hf['model_type']} "
                            f"default ({FAMILY_DEFAULTS[hf['model_type']]['rope_theta']}).")
    out: dict[str, Any] = {"rope_theta": float(p["rope_theta"]),
                           "rope_scaling": "none" if kind == "default" else kind}
    # the pretraining length: a top-level original_max_position_embeddings wins (transformers' rule), else
    # the rope settings', else max_position_embeddings (the family's default when config.json has none)
    original = hf.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings") or 0)

    def need(key):
        if p.get(key) is None:
            raise HFFormatError(f"{where}: RoPE type '{kind}' needs '{key}' in its rope settings.")
        return p[key]

    if kind == "linear":
        factor = need("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            # (transformers multiplies positions by 1 / factor; the reach of such weights, max_position_embeddings
            # x factor, is no length: a changed scaling's unscaled length never ended its search)
            raise HFFormatError(f"{where}: linear rope factor={json.dumps(factor)}; it must be a positive number "
                                f"(the extended context over max_position_embeddings, e.g. 4.0).")
        out["rope_factor"] = float(factor)
    elif kind == "llama3":
        out.update(rope_factor=float(need("factor")), rope_low_freq_factor=float(need("low_freq_factor")),
                   rope_high_freq_factor=float(need("high_freq_factor")), rope_original_max_len=original)
    elif kind == "yarn":
        factor = p.get("factor")
        if factor is None:  # DeepSeek-style: the ratio of the two lengths
            factor = hf["max_position_embeddings"] / original
        attention = p.get("attention_factor")
        if attention is not None and not (isinstance(attention, (int, float)) and attention > 0):
            # transformers multiplies cos and sin by it as given (0: every q.k is 0); 0 here would mean "derive it"
            raise HFFormatError(f"{where}: yarn attention_factor={attention!r}; it must be positive (or "
                                f"null / absent, to derive it from factor and mscale as transformers does).")
        out.update(rope_factor=float(factor), rope_original_max_len=original,
                   rope_beta_fast=float(p.get("beta_fast") or 32.0), rope_beta_slow=float(p.get("beta_slow") or 1.0),
                   rope_mscale=float(p.get("mscale") or 0.0), rope_mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
                   rope_attention_factor=float(p.get("attention_factor") or 0.0),
                   rope_truncate=bool(p.get("truncate", True)))
    return out


def linear_reach(positions: int, factor: float) -> int:
    """The positions a linear scaling by `factor` over max_position_embeddings=`positions` reaches, as longctx
    reads a config.json (transformers: a factor of x handles x times the pre-trained length; vLLM alike):
    the whole positions of positions x factor."""
    return int(positions * factor)


def linear_positions(reach: int, factor: float) -> int:
    """max_position_embeddings for a linear scaling by `factor` that reaches `reach`: the largest whose
    linear_reach is not past it (at least 1), so a config.json read (linear_reach) and written back gives its
    own max_position_embeddings again. int(reach / factor) is not that: 4,096 x 3.3 reads as 13,516, and
    13,516 / 3.3 = 4,095.76 wrote 4,095, one position shorter on every round trip."""
    positions = max(1, int(reach / factor))
    while positions > 1 and linear_reach(positions, factor) > reach:
        positions -= 1
    while linear_reach(positions + 1, factor) <= reach:
        positions += 1
    return positions


def config_reach(config: dict) -> int:
    """The positions a config.json's model reaches as its readers count them: max_position_embeddings,
    times the factor of a linear scaling (whose configs give the length before it)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # (transformers 5 writes rope_parameters)
    factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "linear" else 1
    return linear_reach(config["max_position_embeddings"], factor or 1)
