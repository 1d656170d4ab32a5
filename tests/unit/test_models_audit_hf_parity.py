"""Hugging Face families read as transformers computes them (models audit), on random tiny checkpoints made by
transformers itself, fp32 logits within 1e-4 at 4x original_max_position_embeddings (16 here), where every
scaling bites. What tests/unit/test_hf.py and test_rope_extension_audit.py do not already hold: YaRN's mscale
alone and mscale_all_dim alone (the plain derived factor, as transformers), truncate and beta_* given as null
(transformers: no truncation, the defaults), a top-level original_max_position_embeddings (Phi-3 style: it wins
over the rope settings' own), llama3 without one (max_position_embeddings); config fields that change the math
(head_dim not hidden / heads with biases, a large rms_norm_eps on the q/k norms, tied heads, Qwen3 q/k norms,
Qwen2's fixed q/k/v bias); and the refusals of what longctx does not compute (dynamic NTK and longrope in the
rope_parameters form, partial_rotary_factor inside it, a GELU, a sliding window that binds) rather than running
them as something else."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

ORIGINAL, SEQ, VOCAB, TOL = 16, 64, 200, 1e-4
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}


def _config(family, **extra):
    d = dict(model_type=family, architectures=[ARCH[family]], hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5,
             max_position_embeddings=SEQ, tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32",
             initializer_range=0.1, rope_theta=10000.0, rope_scaling=None)
    if family != "llama":
        d["sliding_window"] = None
    for key, value in extra.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def _hf_dir(tmp_path, config):
    """A random checkpoint saved by transformers' own model (norms and biases randomised too)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path, model


def _yarn(**extra):
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **extra}


CASES = {
    "llama-yarn-mscale-only": ("llama", dict(rope_scaling=_yarn(mscale=1.0))),
    "qwen2-yarn-mscale-all-dim-only": ("qwen2", dict(rope_scaling=_yarn(mscale_all_dim=1.0))),
    "qwen3-yarn-mscale-and-all-dim": ("qwen3", dict(rope_scaling=_yarn(mscale=1.0, mscale_all_dim=0.5))),
    "mistral-yarn-truncate-beta-null": ("mistral", dict(rope_scaling=_yarn(truncate=None, beta_fast=None,
                                                                           beta_slow=None))),
    "llama-yarn-factor-3-betas": ("llama", dict(rope_scaling=_yarn(beta_fast=8.0, beta_slow=0.5, factor=3.0))),
    "qwen3-yarn-top-level-original": ("qwen3", dict(rope_scaling=_yarn(), original_max_position_embeddings=8)),
    "qwen2-llama3-top-level-original": ("qwen2", dict(
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32), original_max_position_embeddings=ORIGINAL)),
    "llama-llama3-without-original": ("llama", dict(
        max_position_embeddings=ORIGINAL,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0))),
    "mistral-linear-rope-parameters": ("mistral", dict(rope_scaling=..., rope_theta=...,
                                                       rope_parameters=dict(rope_type="linear", factor=4.0,
                                                                            rope_theta=5e5))),
    "llama-bias-head-dim-24": ("llama", dict(attention_bias=True, head_dim=24)),
    "qwen2-head-dim-24-tied": ("qwen2", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-head-dim-48-bias-eps": ("qwen3", dict(head_dim=48, attention_bias=True, rms_norm_eps=0.2)),
    "mistral-head-dim-8-window-at-length": ("mistral", dict(head_dim=8, sliding_window=SEQ)),
    "qwen3-window-on-no-layer": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_past_the_original_length(tmp_path, case):
    family, extra = CASES[case]
    path, theirs = _hf_dir(tmp_path, _config(family, **extra))
    ours = load_hf(path)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(tokens).double() - theirs(tokens).logits.double()).abs().max().item()
    assert err <= TOL, err


REFUSED = {
    "dynamic-rope-parameters": ("llama", dict(rope_theta=..., rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                                   rope_theta=1e4)),
                                "RoPE type 'dynamic' is not supported"),
    "longrope": ("qwen2", dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                                 original_max_position_embeddings=ORIGINAL)),
                 "RoPE type 'longrope' is not supported"),
    "partial-rotary-in-rope-parameters": ("qwen3", dict(rope_theta=..., rope_parameters=dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)), "partial_rotary_factor=0.5"),
    "gelu-tanh": ("llama", dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh'"),
    "mistral-window-binds": ("mistral", dict(sliding_window=32), "sliding_window=32"),
    "qwen2-window-binds-a-layer": ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1),
                                   "sliding_window=32"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_longctx_does_not_compute_is_refused_not_run_otherwise(tmp_path, case):
    family, extra, said = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps(_config(family, **extra)))
    with pytest.raises(HFFormatError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_hf(tmp_path)  # (refused from config.json alone, before a weight is read)


@pytest.mark.parametrize("kv", [8, 3, ...])
def test_query_heads_not_a_multiple_of_kv_heads_are_refused_at_load(tmp_path, kv):
    """transformers builds such a model and fails in its first forward; longctx's load_hf built one too, that failed
    in ops/attention.py, naming no key (Qwen3's default num_key_value_heads 32, when config.json has none, over
    4 heads). Found by the models audit."""
    path, _ = _hf_dir(tmp_path, _config("qwen3", num_key_value_heads=kv, head_dim=16))
    said = "num_key_value_heads=32 (config.json has none" if kv is ... else f"num_key_value_heads={kv}"
    with pytest.raises(HFFormatError, match=r"num_attention_heads=4 is not a multiple of " + said.replace("(", r"\(")):
        load_hf(path)
