"""The Hugging Face families longctx reads, and what each one's config.json means where it is silent.

transformers fills a key config.json leaves out with its config class's default, and those differ by
family (Mixtral's rope_theta is 1e6, its and OLMoE's rms_norm_eps 1e-5, Mistral has a 4096-token
sliding window): `with_family_defaults` reads a config.json the same way. The tables copy the field
defaults of transformers' configuration_<family>.py (5.x; the 4.x classes agree on every key here),
kept as data so config/ stays free of torch and transformers; tests/unit/test_hf_as_transformers_reads.py
checks them against the installed classes. Only a missing key takes a default: an explicit null is
read as null (for num_key_value_heads and head_dim, transformers' "as many as the heads" and
"hidden_size / heads"; for sliding_window, no window), as transformers reads it.
"""

from __future__ import annotations

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
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# each family's defaults for the keys that shape what the weights compute: rms_norm_eps,
# max_position_embeddings (also yarn's and llama3's original length when their settings give none),
# num_key_value_heads (absent from a row: as many as the heads), head_dim (absent: hidden_size / heads),
# sliding_window (Mistral's; Qwen's applies only with use_sliding_window: windowed_layers), and
# rope_theta (the class's `default_theta`). From LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
# MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, OlmoeConfig in that order.
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=10000.0, num_key_value_heads=8,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0, num_key_value_heads=32),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0, num_key_value_heads=32,
                  head_dim=128),
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=1e6, num_key_value_heads=8,
                    sliding_window=None),
    "qwen2_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0, num_key_value_heads=16),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0, num_key_value_heads=4),
    "olmoe": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0),
}
# the Mixture-of-Experts keys, from the same classes (output_router_logits: false in every one)
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, norm_topk_prob=False, router_aux_loss_coef=0.001),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      router_aux_loss_coef=0.001),
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01),
}
_EVERY_LAYER_WINDOWED = ("mistral", "mixtral")  # (when their sliding_window is not null)
# the families whose transformers config class reads layer_types (5.x): Qwen3-MoE, Llama and OLMoE have none, so a
# layer_types key in their config.json changes nothing there (Qwen3-MoE windows every layer by use_sliding_window)
_LAYER_TYPES_FAMILIES = ("qwen2", "qwen3", "qwen2_moe")


def with_family_defaults(hf: dict) -> dict:
    """config.json with every key its family defaults filled in where the file has none (not where it is null)."""
    return {**FAMILY_DEFAULTS.get(hf.get("model_type"), {}), **hf}


QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
QWEN_WINDOW_DEFAULTS = dict(sliding_window=4096, max_window_layers=28)  # (every Qwen class's, 5.x and 4.x)


def windowed_layers(hf: dict) -> list[int]:
    """The layers to which transformers' config class gives a sliding window, as it derives them: an
    explicit layer_types' "sliding_attention" entries (of the families that read it); every layer of a
    windowed Mistral / Mixtral; with Qwen's use_sliding_window, Qwen2 / Qwen3's layers from max_window_layers
    on, Qwen2-MoE's even layers below it, every layer of Qwen3-MoE (which has no max_window_layers). No
    window, none."""
    family, layers = hf.get("model_type"), int(hf.get("num_hidden_layers") or 0)
    if family in _EVERY_LAYER_WINDOWED:
        return list(range(layers)) if with_family_defaults(hf).get("sliding_window") is not None else []
    if hf.get("layer_types") and family in _LAYER_TYPES_FAMILIES:
        return [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
    d = {**QWEN_WINDOW_DEFAULTS, **hf}
    if family not in QWEN_FAMILIES or not d.get("use_sliding_window") or d.get("sliding_window") is None:
        return []
    below = int(d.get("max_window_layers") or 0)
    if family in ("qwen2", "qwen3"):
        return list(range(below, layers))
    if family == "qwen2_moe":
        return [i for i in range(min(below, layers)) if i % 2 == 0]
    return list(range(layers))


def family_window(hf: dict) -> int | None:
    """The sliding window transformers gives some layer of this config.json (the class's default when
    the key is absent: windowed_layers); None: no layer has one."""
    if not windowed_layers(hf):
        return None
    defaults = QWEN_WINDOW_DEFAULTS if hf.get("model_type") in QWEN_FAMILIES else {}
    return {**defaults, **with_family_defaults(hf)}.get("sliding_window")


def check_sliding_window(hf: dict, where: str, max_seq_len: int | None = None, key: str = "model.max_seq_len") -> None:
    """Refuse a length past the sliding window of this config.json: `max_seq_len`, the run's `key` (as given, or
    config/hf.py default_max_seq_len: the window where it binds), or when None (a model read outside a run's
    config: models/hf.py load_hf, which no command's window check guards) max_position_embeddings. longctx has
    no sliding-window attention; it attends to every earlier position, the window's attention up to W and not
    beyond."""
    family = hf.get("model_type")
    window = family_window(hf)
    if window is None:
        return
    config_class = FAMILIES[family].replace("ForCausalLM", "Config")
    said = f"sliding_window={window}" + ("" if "sliding_window" in hf else
                                        f" ({config_class}'s default: config.json has no sliding_window)")
    if max_seq_len is None:
        key, max_seq_len = "max_position_embeddings", with_family_defaults(hf)["max_position_embeddings"]
    if max_seq_len <= window:
        return
    fix = {"model.max_seq_len": f"Drop --model.max_seq_len (for these weights it defaults to {window}) or give "
                                f"{window} or less",
           "max_position_embeddings": f"Use it within its window: through model.init_from or --checkpoint, whose "
                                      f"model.max_seq_len defaults to {window}"}.get(key, f"Keep {key} at {window} "
                                                                                         f"or less")
    raise HFFormatError(
        f"{where}: {key}={max_seq_len} passes the model's sliding-window attention ({said}). longctx has no "
        f"sliding-window attention: it attends to every earlier position, the same as the window up to {window} "
        f"positions and not beyond, so past them the model's outputs (and its training) would not be these "
        f"weights'. {fix}; or set {'use_sliding_window false' if family in QWEN_FAMILIES else 'sliding_window null'} "
        f"in config.json if the weights were trained without one.")


def check_unquantized(hf: dict, where: str) -> None:
    """Refuse a config.json whose weights are stored quantized: read as they are, they compute another model."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise HFFormatError(f"{where}: quantization_config (quant_method {method}): the weights are stored quantized "
                            f"(fp8 blocks with their scales, GPTQ, AWQ, ...), and longctx reads unquantized weights "
                            f"only (read as they are, they would compute another model). Use the model's bf16 "
                            f"release, or dequantize it once and save that copy.")
