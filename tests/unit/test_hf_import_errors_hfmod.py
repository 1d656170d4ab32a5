"""Damaged Hugging Face directories said as one HFFormatError naming the file and the fix, not a traceback: an
index cut short, without a weight_map, or placing tensors in a shard that does not hold them (files of two
revisions mixed); and a Mixture of Experts whose config.json says a dense model_type (its expert key named)."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.models.hf import HFFormatError, load_hf, save_hf, weight_files  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402


def _sharded(tmp_path):
    cfg = load_config(overrides=["--model.dim=32", "--model.ffn_dim=64", "--model.layers=1"]).model
    return save_hf(build_model(cfg), tmp_path / "ok", max_shard_bytes=10_000)


def _swap_two_shards(index: dict) -> None:
    wm = index["weight_map"]
    a, b = "model.embed_tokens.weight", "model.norm.weight"
    wm[a], wm[b] = wm[b], wm[a]


@pytest.mark.parametrize("damage, said", [
    ('{"weight_map": {', "is not valid JSON"),
    ('{"metadata": {}}', "has no weight_map object"),
    ('{"weight_map": []}', "has no weight_map object"),
    ("[1, 2]", "has no weight_map object"),
    (_swap_two_shards, "which does not hold them, e.g. model"),
], ids=["cut-short", "no-map", "map-a-list", "a-list", "wrong-shard"])
def test_a_damaged_index_is_one_error_naming_it(tmp_path, damage, said):
    out = _sharded(tmp_path)
    d = tmp_path / "damaged"
    shutil.copytree(out, d)
    index = d / "model.safetensors.index.json"
    if callable(damage):
        j = json.loads(index.read_text())
        damage(j)
        index.write_text(json.dumps(j))
    else:
        index.write_text(damage)
    for read in (weight_files, load_hf):  # (weight_files: what train's preflight and generate check first)
        with pytest.raises(HFFormatError, match=said) as e:
            read(d)
        assert str(index) in str(e.value)
    assert load_hf(out).cfg.layers == 1  # (the intact export loads)


def test_moe_weights_under_a_dense_model_type_name_the_expert_key(tmp_path):
    config = dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    with pytest.raises(HFFormatError, match=r"Mixture of Experts .*num_experts=4.*'qwen2' is a dense family.*"
                                            r"qwen2_moe"):
        load_hf(d, dtype=torch.float32)


def test_a_base_model_checkpoint_without_the_model_prefix_loads_as_transformers_does(tmp_path):
    """Saved from AutoModel (embed_tokens.weight, layers.0...: embedding models ship so) with tied embeddings:
    transformers' AutoModelForCausalLM adds the prefix and computes the logits; longctx refused it as lacking
    every tensor."""
    config = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=128,
                  tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    base = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**config))
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(d / "model.safetensors"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_hf(d)
    t = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(t) - ref(t).logits).abs().max().item() <= 1e-4
    untied = tmp_path / "untied"  # (no head to read: refused, where transformers would draw one at random)
    shutil.copytree(d, untied)
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(HFFormatError, match="lm_head.weight"):
        load_hf(untied)
