"""A model trained with the switch router (top-1 of a softmax, weighed by its probability whatever moe.norm_topk
says) is the softmax top-1 without renormalisation, which Qwen2-MoE, Qwen3-MoE and OLMoE express
(norm_topk_prob false): the export writes that, and transformers computes the model's logits; read back it is
the same model. Before, the export refused it as having "no transformers equivalent". Mixtral renormalises its
top-1 weight to 1, so a switch Mixtral is still refused."""

import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longctx.config import ModelConfig  # noqa: E402
from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.models.hf import load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

BASE = dict(dim=32, layers=2, heads=2, kv_heads=2, ffn_dim=16, vocab_size=64, max_seq_len=64, moe_experts=4,
            moe_top_k=1, moe_expert_dim=16, moe_router="switch", moe_norm_topk=True, init_std=0.3)
FAMILIES = {"qwen2_moe": dict(qkv_bias=True), "qwen3_moe": dict(qk_norm=True),
            "olmoe": dict(qk_norm=True, qk_norm_span="all")}


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_switch_model_exports_as_top1_without_renormalisation(family):
    model = build_model(ModelConfig(family=family, **BASE, **FAMILIES[family]), device="cpu", seed=0).eval()
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        back = load_hf(d).eval()
        ours = _logits(model, tokens)
        assert theirs.config.norm_topk_prob is False
        assert (_logits(theirs, tokens) - ours).abs().max() < 1e-4
        assert (_logits(back, tokens) - ours).abs().max() < 1e-4
    # (renormalised, every weight would be 1: the export must not compute that)
    renormed = build_model(ModelConfig(family=family, **{**BASE, "moe_router": "softmax"}, **FAMILIES[family]),
                           device="cpu", seed=0).eval()
    assert (_logits(renormed, tokens) - ours).abs().max() > 1e-3


def test_a_switch_mixtral_is_refused():
    model = build_model(ModelConfig(family="mixtral", **BASE), device="cpu", seed=0)
    with tempfile.TemporaryDirectory() as d, pytest.raises(HFFormatError, match="mixtral renormalises"):
        save_hf(model, d)
