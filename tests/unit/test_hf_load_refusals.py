"""Hugging Face directories that longctx would read as another model than the one stored are refused, each with
what to do (an audit found each loading silently, logits off by 4 to 38):
- quantized weights (a config.json with quantization_config: the Qwen3 FP8 releases' float8 blocks with their
  scales; or a float8 / integer tensor without it): cast as they are, they are other weights;
- tie_word_embeddings true beside an lm_head.weight that differs from the embedding (transformers 5 unties such
  a model and uses the head, 4.x ties it): the config must say which;
- Qwen3-MoE's use_sliding_window with a layer_types key, which its transformers class does not read (it
  windows every layer): the key no longer hides the window."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from longctx.config import load_config
from longctx.config.hf_families import HFFormatError, windowed_layers
from longctx.models.hf import load_hf, save_hf
from longctx.models.llama import build_model


@pytest.fixture
def hf_dir(tmp_path):
    cfg = load_config(overrides=["--model.layers=1", "--model.vocab_size=64", "--model.dim=32", "--model.heads=2",
                                 "--model.kv_heads=1", "--model.ffn_dim=48"]).model
    return save_hf(build_model(cfg, seed=1), tmp_path / "hf")


def _edit(path, config=None, tensors=None):
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**c, **config}))
    if tensors is not None:
        state = load_file(path / "model.safetensors")
        save_file(tensors(state), path / "model.safetensors", metadata={"format": "pt"})


def test_a_quantized_checkpoint_is_refused_before_its_weights_are_read(hf_dir):
    _edit(hf_dir, config={"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    with pytest.raises(HFFormatError, match="quantization_config \\(quant_method fp8\\).*unquantized weights only"):
        load_hf(hf_dir)


def test_a_float8_tensor_is_refused_even_without_a_quantization_config(hf_dir):
    def quantize(state):
        name = next(k for k in state if k.endswith("q_proj.weight"))
        return {**state, name: state[name].to(torch.float8_e4m3fn)}

    _edit(hf_dir, tensors=quantize)
    with pytest.raises(HFFormatError, match="q_proj.weight is stored as F8_E4M3, a quantized weight"):
        load_hf(hf_dir)


def test_a_tied_config_beside_a_different_head_is_refused_and_the_same_head_loads(hf_dir):
    _edit(hf_dir, config={"tie_word_embeddings": True},
          tensors=lambda s: {**s, "lm_head.weight": s["model.embed_tokens.weight"].clone()})
    tied = load_hf(hf_dir)  # (the same tensor twice: tied, as config.json says)
    assert tied.output is None
    _edit(hf_dir, tensors=lambda s: {**s, "lm_head.weight": s["lm_head.weight"] + 1.0})
    with pytest.raises(HFFormatError, match="tie_word_embeddings true, but the files hold an lm_head.weight that "
                                            "differs .*Set tie_word_embeddings to false"):
        load_hf(hf_dir)


@pytest.mark.parametrize("family,layer_types,windowed", [
    ("qwen3_moe", ["full_attention"] * 2, [0, 1]),  # (no layer_types in its class: use_sliding_window windows all)
    ("qwen2_moe", ["full_attention"] * 2, []),  # (its class reads layer_types)
    ("qwen3", ["sliding_attention", "full_attention"], [0]),
    ("llama", ["sliding_attention"] * 2, []),  # (never windowed by transformers)
])
def test_layer_types_count_only_for_the_families_that_read_them(family, layer_types, windowed):
    hf = {"model_type": family, "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 16,
          "layer_types": layer_types}
    assert windowed_layers(hf) == windowed
