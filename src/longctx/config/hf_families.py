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
# sliding_window (Mistral's; Qwen's applies only with use_sliding_window: windowed_layers),
# rope_theta (the class's `default_theta`) and pad_token_id (absent from a row: none; OLMoE's is 1).
# From LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig,
# OlmoeConfig in that order.
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
    "olmoe": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0, pad_token_id=1),
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
    for key in (k for k in _NUMBER_KEYS if k in hf):
        if not _is_number(hf[key]):
            raise HFFormatError(f"{where}: {key} is {json.dumps(hf[key])}, not a number (transformers would build "
                                f"a model that fails or computes with it); set it to the value the weights were "
                                f"trained with, or remove the key for the {family} default "
                                f"({FAMILY_DEFAULTS[family].get(key)}).")
        whole = key != "max_position_embeddings" or isinstance(hf[key], int)  # (transformers' int field)
        if hf[key] <= 0 or not whole:  # (was model.norm_eps / max_seq_len's rule naming keys never set; 8.5 read as 8)
            raise bad(key, hf[key], "a positive " + ("number" if key == "rms_norm_eps" else "integer") +
                      _write_as(hf[key]))
    if hf.get("num_key_value_heads") == 0:  # (transformers divides by it; null, not 0, means as many as the heads)
        raise bad("num_key_value_heads", 0, "a positive integer (or null: as many as the heads)")
    check_pad_token(hf, where)
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


# the expert count's names, the family's own first (transformers' attribute_map makes either one
# work; Hub configs write num_experts for Qwen3-MoE, transformers 5 num_local_experts)
EXPERT_KEYS = {"mixtral": ("num_local_experts", "num_experts"), "qwen2_moe": ("num_experts",),
               "qwen3_moe": ("num_local_experts", "num_experts"), "olmoe": ("num_experts", "num_local_experts")}


def experts_key(hf: dict, family: str) -> str:
    """The config.json key that gives the expert count (the family's own name when none does)."""
    keys = EXPERT_KEYS.get(family, ("num_experts",))
    return next((k for k in keys if hf.get(k) is not None), keys[0])


# the Mixture-of-Experts keys longctx reads, by family, with what each must hold: "count" an integer >= 0,
# "size" one >= 1, "weight" a number >= 0 (an int too: transformers 4 reads one, and longctx takes float() of it)
_MOE_VALUE_KEYS = {
    "num_experts_per_tok": "count", "router_aux_loss_coef": "weight", "router_z_loss_coef": "weight",
    "moe_intermediate_size": "size", "shared_expert_intermediate_size": "count", "decoder_sparse_step": "size",
}
_MOE_KEY_FAMILIES = {"moe_intermediate_size": ("qwen2_moe", "qwen3_moe"), "shared_expert_intermediate_size":
                     ("qwen2_moe",), "decoder_sparse_step": ("qwen2_moe", "qwen3_moe")}
_WANT = {"count": "an integer (0 or more)", "size": "a positive integer", "weight": "a number (0 or more)"}


def check_moe_values(hf: dict, where: str) -> None:
    """Every Mixture-of-Experts value of `hf` that longctx reads (the family's own keys) has the type and range
    its reader computes with, or an HFFormatError naming the key, its value and the fix. Before, an expert count
    "8" stopped with a bare TypeError ('<=' between str and int), and 8.5, true or null were read silently as 8,
    1 or the family's default, a model transformers refuses. An integer key holds a JSON integer: transformers
    5's config classes are strict dataclasses that refuse 8.0 for an int field (and 4.x's build failed in
    range(8.0)), so an integral float is refused too, with the integer to write (_write_as). An explicit null is
    refused where transformers' class has no null (every key here: only a missing key takes the family default)."""
    family = hf.get("model_type")

    def bad(key, value, want, fix="set it to the value the weights were trained with"):
        fix = f"write {int(value)}, a JSON integer" if _write_as(value) and want != _WANT["weight"] else fix
        why = ("a key only longctx's export writes (transformers never reads it)" if key == "router_z_loss_coef" else
               f"transformers' {FAMILIES[family].replace('ForCausalLM', 'Config')} refuses it or builds no model "
               f"from it")
        return HFFormatError(f"{where}: {key} is {json.dumps(value)}, not {want}: {why}; {fix}.")

    keys = [k for k in EXPERT_KEYS[family] if k in hf]
    for key in keys:
        if not _is_count(hf[key]):
            raise bad(key, hf[key], "an integer (the routed experts per layer)",
                      "set it to the number of experts the weights hold (a layer's experts.N tensors)")
    if len(keys) == 2 and hf[keys[0]] != hf[keys[1]]:  # (transformers' attribute_map lets the alias win)
        raise HFFormatError(f"{where}: the expert count is given twice, {keys[0]}={hf[keys[0]]} and {keys[1]}="
                            f"{hf[keys[1]]}, and transformers reads {keys[1]}'s; keep one of the keys (the one "
                            f"that matches the experts the weights hold).")
    for key, kind in _MOE_VALUE_KEYS.items():
        if key not in hf or family not in _MOE_KEY_FAMILIES.get(key, (family,)):
            continue
        value = hf[key]
        if value is None and key == "router_z_loss_coef":  # (null: no z-loss, as a file without the key)
            continue
        fine = _is_number(value) and value >= 0 if kind == "weight" else _is_count(value) and (kind == "count" or
                                                                                               value >= 1)
        if not fine:
            raise bad(key, value, _WANT[kind])
    only = hf.get("mlp_only_layers") if family in ("qwen2_moe", "qwen3_moe") else None
    if only is not None and not (isinstance(only, list) and all(_is_count(i) for i in only)):
        raise bad("mlp_only_layers", only, "a list of layer indices (or null)",
                  "write the dense layers as a list of integers, e.g. [0, 1]")


def _write_as(value) -> str:
    """The integer to write for an integral float (transformers 5's strict config classes refuse 8.0 for an int
    field, and 4.x's builds failed in range(8.0)); '' for any other value."""
    return f" (write {int(value)}, a JSON integer)" if isinstance(value, float) and value.is_integer() else ""


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_pad_token(hf: dict, where: str) -> None:
    """config.json's pad_token_id, which every family longctx reads passes to its nn.Embedding as padding_idx:
    an integer (or null: none) that torch's embedding takes, -vocab_size up to vocab_size - 1 (a negative one
    counts from the end, as torch counts it; transformers warns and builds it). Else transformers refuses the
    file (a float, text or bool: its strict config class) or fails building the embedding (out of range)."""
    pad, vocab = hf.get("pad_token_id"), hf["vocab_size"]
    if pad is None or isinstance(pad, int) and not isinstance(pad, bool) and -vocab <= pad < vocab:
        return
    want = "a token id below vocab_size" if isinstance(pad, int) and not isinstance(pad, bool) else "an integer"
    raise HFFormatError(f"{where}: pad_token_id is {json.dumps(pad)}, not {want} ({vocab}) or null: transformers' "
                        f"{FAMILIES[hf['model_type']]} takes it as its embedding's padding_idx and cannot build that "
                        f"embedding; set the id of the pad token in the weights' tokenizer{_write_as(pad)}, or null if "
                        f"it has none.")


def embedding_padding_idx(hf: dict) -> int:
    """model.padding_idx for config.json `hf` (checked by check_pad_token): the row transformers' embedding gives no
    gradient, its pad_token_id (the family's default where the file has none: OLMoE's 1) counted as torch counts a
    negative one; -1 when none."""
    pad = with_family_defaults(hf).get("pad_token_id")
    return -1 if pad is None else pad % hf["vocab_size"]


def check_heads(hf: dict, where: str) -> None:
    """The attention shape of config.json `hf` (read with its family defaults) that some model computes, said by
    config.json's keys: before, a run stopped at the rules of model.heads / model.kv_heads / model.dim, keys the user
    never set, and load_hf alone named the file. transformers refuses hidden_size not divisible by the heads without
    a head_dim (its class validation) and fails in its forward on the other two."""
    d = with_family_defaults(hf)
    heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if heads % kv_heads:
        kv_said = "" if "num_key_value_heads" in hf else f" (config.json has none: {hf['model_type']}'s default)"
        raise HFFormatError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
                            f"{kv_said}: grouped-query attention shares each key/value head among a whole number of "
                            f"query heads, so no model computes it. Set num_key_value_heads to the weights' (their "
                            f"k_proj rows / head_dim).")
    if not d.get("head_dim") and hf["hidden_size"] % heads:
        raise HFFormatError(f"{where}: hidden_size={hf['hidden_size']} is not a multiple of num_attention_heads="
                            f"{heads} and config.json gives no head_dim: set head_dim to the weights' (their q_proj "
                            f"rows / num_attention_heads).")
    head_dim = d.get("head_dim") or hf["hidden_size"] // heads
    if head_dim % 2:
        raise HFFormatError(f"{where}: the head size {head_dim} is odd, and RoPE rotates pairs of dimensions, so no "
                            f"{hf['model_type']} computes it; set head_dim (or hidden_size / num_attention_heads) to "
                            f"the weights' head size.")
