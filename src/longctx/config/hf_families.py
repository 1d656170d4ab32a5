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
# sliding_window (Mistral's; Qwen's applies only with use_sliding_window, which longctx refuses), and
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
_CONFIG_CLASS = {"mistral": "MistralConfig", "mixtral": "MixtralConfig"}


def with_family_defaults(hf: dict) -> dict:
    """config.json with every key its family defaults filled in where the file has none (not where it is null)."""
    return {**FAMILY_DEFAULTS.get(hf.get("model_type"), {}), **hf}


def family_window(hf: dict) -> int | None:
    """The sliding window transformers gives every layer of a Mistral or Mixtral config.json (its class's
    default when the key is absent); None: no window, or another family."""
    return with_family_defaults(hf).get("sliding_window") if hf.get("model_type") in _CONFIG_CLASS else None


def check_sliding_window(hf: dict, where: str, max_seq_len: int | None = None) -> None:
    """Refuse a config.json whose attention is windowed within the run's length: `max_seq_len` (the
    run's model.max_seq_len) or, when None, max_position_embeddings. longctx trains full causal
    attention only, which is a W-token window's exactly up to W tokens and not beyond."""
    family = hf.get("model_type")
    windowed = "sliding_attention" in (hf.get("layer_types") or [])
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        windowed = windowed or bool(hf.get("use_sliding_window"))
    if windowed:
        raise HFFormatError(f"{where}: the model uses sliding-window attention (sliding_window="
                            f"{hf.get('sliding_window')}); longctx trains full causal attention only.")
    window = family_window(hf)
    if window is None:
        return
    said = f"sliding_window={window}" + ("" if "sliding_window" in hf else
                                        f" ({_CONFIG_CLASS[family]}'s default: config.json has no sliding_window)")
    if max_seq_len is None:
        length, max_seq_len = "max_position_embeddings", with_family_defaults(hf)["max_position_embeddings"]
    else:
        length = "model.max_seq_len"
    if window < max_seq_len:
        raise HFFormatError(
            f"{where}: {length}={max_seq_len} passes the model's sliding-window attention ({said}); longctx trains "
            f"full causal attention only, the same as the window up to {window} tokens and not beyond. Use it "
            f"within its window (model.init_from with --model.max_seq_len {window} or less), or set sliding_window "
            f"null in config.json if the weights were trained without one.")
