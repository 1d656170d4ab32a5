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

import json

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
        f"weights'. {fix}; or set {window_off_keys(hf)} "
        f"in config.json if the weights were trained without one.")


def window_off_keys(hf: dict) -> str:
    """The config.json change that gives the weights of `hf` full attention in every layer, as transformers reads it:
    sliding_window null (Mistral, Mixtral), use_sliding_window false (Qwen), and, where an explicit layer_types
    windows some layer (it wins over use_sliding_window: windowed_layers), its entries full_attention, without
    which the first change alone left the window (and transformers' cache fails on a window of None)."""
    if hf.get("model_type") not in QWEN_FAMILIES:
        return "sliding_window null"
    if hf.get("model_type") in _LAYER_TYPES_FAMILIES and "sliding_attention" in (hf.get("layer_types") or ()):
        return "use_sliding_window false and every layer_types entry to \"full_attention\""
    return "use_sliding_window false"


def qwen_moe_dense_layers(d: dict, where: str) -> set[int]:
    """The layers of a Qwen2-MoE / Qwen3-MoE config.json (`d`, with the family's MoE defaults) that transformers
    builds dense. Its rule: layer i has experts iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    is 0. Refused where that leaves every layer dense: such a file is its dense family's model, and read as a MoE
    it passed a bare model.load_hf but stopped every run at "set model.moe.experts 0", which the weights' own
    num_experts then refused."""
    step, layers = d.get("decoder_sparse_step", 1), d["num_hidden_layers"]
    if not isinstance(step, int) or step < 1:
        raise HFFormatError(f"{where}: decoder_sparse_step={step!r}; it must be a positive integer.")
    only = set(d.get("mlp_only_layers") or [])
    dense = {i for i in range(layers) if i in only or (i + 1) % step}
    if len(dense) == layers:
        family = {"qwen3_moe": "qwen3"}.get(d["model_type"], "qwen2 (llama where qkv_bias is false)")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]  # (qwen3's default is 128)
        raise HFFormatError(
            f"{where}: decoder_sparse_step={step} and mlp_only_layers={sorted(only)} leave none of the "
            f"{layers} layers with experts, so the weights are a dense model that the Mixture-of-Experts family "
            f"{d['model_type']} cannot train or export as such. Set model_type {family} and head_dim {head_dim}: "
            f"that family reads the same weights and computes the same function.")
    return dense


def check_unquantized(hf: dict, where: str) -> None:
    """Refuse a config.json whose weights are stored quantized: read as they are, they compute another model."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise HFFormatError(f"{where}: quantization_config (quant_method {method}): the weights are stored quantized "
                            f"(fp8 blocks with their scales, GPTQ, AWQ, ...), and longctx reads unquantized weights "
                            f"only (read as they are, they would compute another model). Use the model's bf16 "
                            f"release, or dequantize it once and save that copy.")


# config.json's keys by the value each must hold (a key left out takes its family default; see check_hf_values)
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_COUNT_KEYS = ("num_key_value_heads", "head_dim", "sliding_window", "max_window_layers")  # (null: derived / none)
_NUMBER_KEYS = ("rms_norm_eps", "max_position_embeddings")  # (null: refused, as transformers cannot use it)
_OPTIONAL_NUMBER_KEYS = ("original_max_position_embeddings", "partial_rotary_factor", "initializer_range")
# switches read with bool(): "false" as text would read as true (transformers 5 refuses a non-bool)
_SWITCH_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "use_sliding_window",
                "norm_topk_prob", "output_router_logits")
_ROPE_NUMBER_KEYS = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                     "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "partial_rotary_factor")  # (attention_factor: hf_rope.py, where 0 is refused too)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_hf_values(hf: dict, where: str) -> None:
    """A config.json of a family longctx reads whose values have the types the readers compute with: the
    shapes positive integers, the counts integers or null, the numbers numbers, the RoPE settings an object.
    Read otherwise, a malformed value stopped every command with a bare TypeError (a null
    max_position_embeddings, a hidden_size as text), or was taken silently (a linear factor "2" multiplied
    max_position_embeddings as text: a 256-digit max_seq_len)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFFormatError(f"{where}: model_type '{family}' is not supported; longctx reads "
                            f"{', '.join(FAMILIES)} (the Llama architecture, its close variants and their "
                            f"Mixture-of-Experts versions).")

    def bad(key, value, want):
        return HFFormatError(f"{where}: {key} is {json.dumps(value)}, not {want}, so the model it describes cannot "
                             f"be read; set it to the value the weights were trained with.")

    for key in _SHAPE_KEYS:
        if key not in hf:
            raise HFFormatError(f"{where}: the required key '{key}' is missing.")
        if not isinstance(hf[key], int) or isinstance(hf[key], bool) or hf[key] < 1:
            raise bad(key, hf[key], "a positive integer")
    for key in _COUNT_KEYS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise bad(key, value, "an integer (or null)")
    for key in _NUMBER_KEYS:
        if key in hf and not _is_number(hf[key]):
            raise HFFormatError(f"{where}: {key} is {json.dumps(hf[key])}, not a number (transformers would build "
                                f"a model that fails or computes with it); set it to the value the weights were "
                                f"trained with, or remove the key for the {family} default "
                                f"({FAMILY_DEFAULTS[family].get(key)}).")
    for key in _OPTIONAL_NUMBER_KEYS:
        if hf.get(key) is not None and not _is_number(hf[key]):
            raise bad(key, hf[key], "a number (or null)")
    for key in _SWITCH_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], (bool, int)):
            raise bad(key, hf[key], "true or false")
    for name in ("rope_scaling", "rope_parameters"):
        rope = hf.get(name)
        if rope is not None and not isinstance(rope, dict):
            raise bad(name, rope, "an object of RoPE settings (or null)")
        settings = [rope] if rope and not all(isinstance(v, dict) for v in rope.values()) else []
        for key in (k for s in settings for k in _ROPE_NUMBER_KEYS if s.get(k) is not None):
            if not _is_number(settings[0][key]):
                raise bad(f"{name}.{key}", settings[0][key], "a number")
