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


def test_layers_past_num_hidden_layers_are_not_refused_nor_read(tmp_path, monkeypatch):
    """A config.json that keeps fewer layers than the files hold (a model cut to its first layers; a checkpoint
    with an extra MTP-style layer past num_hidden_layers): the model it describes is computed, as transformers
    loads it (listing the rest as weights not used). It was refused as tensors config.json gives no place, after
    every rank had read each of those tensors whole."""
    import transformers

    import longctx.models.hf as hf_module

    config = hf_config("llama", num_hidden_layers=3)
    d, _ = random_hf_dir(tmp_path, config)
    cut = {**config, "num_hidden_layers": 2}
    (d / "config.json").write_text(json.dumps(cut))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()  # (transformers: layer 2 unused)
    read = []
    real = hf_module._nonzero
    monkeypatch.setattr(hf_module, "_nonzero", lambda stored, *a: read.append(stored) or real(stored, *a))
    ours = load_hf(d)
    assert len(ours.layers) == 2 and max_err(ours, ref) <= 1e-4
    assert read == []  # (the cut layer's tensors are not read)


def test_an_unused_tensor_is_read_in_blocks_of_rows(tmp_path):
    """The zero test of an unused tensor reads a block of rows at a time and stops at the first non-zero one."""
    from longctx.models.hf import _nonzero

    class Slice:
        def __init__(self, t):
            self.t, self.reads = t, []

        def get_shape(self):
            return list(self.t.shape)

        def __getitem__(self, index):
            self.reads.append(index)
            return self.t[index]

    first = Slice(torch.cat([torch.ones(1, 4), torch.zeros(9, 4)]))
    assert _nonzero(first, rows=3) and first.reads == [slice(0, 3)]
    zeros = Slice(torch.zeros(10, 4))
    assert not _nonzero(zeros, rows=3) and len(zeros.reads) == 4
    assert _nonzero(Slice(torch.tensor(2.0))) and not _nonzero(Slice(torch.zeros(0, 4)))


def test_a_shared_expert_of_real_width_beside_no_shared_expert_is_refused(tmp_path):
    """A Qwen2-MoE config.json without a shared expert (shared_expert_intermediate_size 0): its 0-wide expert and
    the gate (which gates nothing) stay accepted (tests/unit/test_hf_moe.py), but every *.mlp.shared_expert* tensor
    was skipped by its name, unread, so files holding a shared expert of real width loaded without it."""
    from test_hf_moe import hf_config as moe_config
    from test_hf_moe import random_hf_dir as moe_dir

    config = moe_config("qwen2_moe-mlp_only")  # (shared_expert_intermediate_size 48)
    d, _ = moe_dir(tmp_path, config)
    (d / "config.json").write_text(json.dumps({**config, "shared_expert_intermediate_size": 0}))
    with pytest.raises(HFFormatError, match=r"holds 6 tensors .* model.layers.0.mlp.shared_expert.down_proj.weight"):
        load_hf(d)


def test_layers_past_num_hidden_layers_are_said(tmp_path, capsys):
    """A config.json that is wrong (every layer the files hold is the model's) loaded a shorter model without a word
    once layers past num_hidden_layers were skipped: a note names them and the key that would read them."""
    config = hf_config("llama", num_hidden_layers=4)
    d, _ = random_hf_dir(tmp_path, config)
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert len(load_hf(d).layers) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "holds layers 2-3 past config.json's num_hidden_layers = 2, not loaded" in said, said
    assert "set num_hidden_layers to 4 in config.json" in said
