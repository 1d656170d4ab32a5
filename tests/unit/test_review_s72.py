"""Review of 2026-11-30's changes (rev72): the length guard's reach for a Hugging Face model whose
config.json carries a llama3 RoPE scaling (config/positions.py scaled_reach).

The reference is vLLM's rule (vllm/config: _get_and_verify_max_len): a llama3 rope_type leaves
max_position_embeddings as it is (the length the model was trained to after its scaling: Llama-3.2's
131,072 with factor 32 over 8,192), while yarn derives original x factor. longctx trusted a llama3
model with max(max_position_embeddings, original x factor): Llama-3.2's 262,144, twice what it was
trained on, so prompts between the two ran with no note."""

import json

import pytest

from longctx.config import load_config
from longctx.config.positions import model_reach


def _hf(tmp_path, rope_scaling: dict, positions: int):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
        max_position_embeddings=positions, rope_theta=500000.0, rope_scaling=rope_scaling)))
    return model_reach(load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=64"]).model)


def _vllm_max_len(rope_scaling: dict, positions: int) -> int:
    """vLLM's derived max_model_len for one rope_scaling dict (its branch for these two types)."""
    kind = rope_scaling["rope_type"]
    if kind in ("su", "longrope", "llama3"):
        return positions
    base = rope_scaling["original_max_position_embeddings"] if kind == "yarn" else positions
    return int(base * rope_scaling["factor"])


def test_a_llama3_scaled_hf_model_reaches_its_max_position_embeddings(tmp_path):
    # Llama-3.2's shape scaled down: x 32 over 8 (original x factor 256) for 128 positions
    llama3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8)
    reach = _hf(tmp_path, llama3, 128)
    assert reach.positions == _vllm_max_len(llama3, 128) == 128  # (was 256)
    assert not reach.scaled


@pytest.mark.parametrize("original", [64, 16])
def test_a_yarn_scaled_hf_model_still_reaches_original_times_factor(tmp_path, original):
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=original)
    reach = _hf(tmp_path, yarn, 64)
    # (vLLM: original x factor; longctx keeps max_position_embeddings when that is longer)
    assert reach.positions == max(64, _vllm_max_len(yarn, 64))
