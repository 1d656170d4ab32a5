"""Tensors in an hf:DIR's safetensors that config.json gives no place: refused, as the tensors config.json implies
and the files lack are. They were dropped without a word: a Llama whose attention biases config.json leaves out
(attention_bias false) loaded and computed logits 3 off the weights' own (transformers lists such weights as "not
used"; longctx said nothing). Tensors that compute nothing stay accepted: RoPE's inv_freq buffers, empty or all-zero
tensors (a zero bias), a Qwen2-MoE's 0-wide shared expert (tests/unit/test_hf_moe.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf import hf_config, max_err, random_hf_dir

from longctx.config.hf import HFFormatError
from longctx.models.hf import load_hf


def _add(d, tensors: dict) -> None:
    state = load_file(str(d / "model.safetensors"))
    save_file({**state, **tensors}, str(d / "model.safetensors"))


def test_biases_config_json_leaves_out_are_refused(tmp_path):
    config = hf_config("llama", attention_bias=True)
    d, _ = random_hf_dir(tmp_path, config)
    (d / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(HFFormatError, match=r"holds 8 tensors that config.json gives no place, e.g. "
                                            r"model.layers.0.self_attn.k_proj.bias.*attention_bias true"):
        load_hf(d)


def test_q_k_norms_of_another_family_are_refused(tmp_path):
    d, _ = random_hf_dir(tmp_path, hf_config("mistral"))
    _add(d, {"model.layers.1.self_attn.q_norm.weight": torch.full((32,), 1.5)})
    with pytest.raises(HFFormatError, match=r"holds 1 tensors .* model.layers.1.self_attn.q_norm.weight"):
        load_hf(d)


def test_tensors_that_compute_nothing_are_accepted(tmp_path):
    d, ref = random_hf_dir(tmp_path, hf_config("mistral"))
    _add(d, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(128),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(16), "model.extra": torch.zeros(0, 4),
             "model.scale": torch.tensor(0.0)})  # (a 0-dim tensor is read too)
    assert max_err(load_hf(d), ref) <= 1e-4
