"""The activation count the planner uses (memory/accounting.py) for models with q/k norms (model.qk_norm:
Qwen3, Qwen3-MoE, OLMoE): each norm keeps its input's fp32 copy, the normed values and an rsqrt per row.
The count left them out, so a qwen3-30b-a3b plan without recomputation (or with selective + offload,
whose stored tokens keep them on the host) predicted less memory than the run holds."""

import pytest
import torch

from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model

SEQ = 256
MODELS = {
    "qwen3 (per head)": ["--model.family=qwen3", "--model.qk_norm=true"],
    "olmoe (whole projection)": ["--model.preset=debug-moe", "--model.family=olmoe", "--model.qk_norm=true",
                                 "--model.qk_norm_span=all", "--model.moe.dense_layers="],
}


@pytest.mark.parametrize("policy", [MemoryPolicy("none"), MemoryPolicy("selective", 0.5), MemoryPolicy("full")],
                         ids=lambda p: p.describe())
@pytest.mark.parametrize("over", list(MODELS.values()), ids=list(MODELS))
def test_qk_norm_activations_are_counted(over, policy):
    cfg = load_config(overrides=["--model.layers=3", *over]).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, policy.recompute, policy.offload_fraction,
                                                  offload_skip_last=policy.offload_skip_last)
    model.loss_chunk = 0
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    measured = measure_activations(model, tokens, labels=tokens)
    est = estimate_activations(cfg, SEQ, 1, policy=policy, dtype_bytes=4)
    assert measured["total_device"] == pytest.approx(est.total_device, rel=1e-4)
    assert measured["total_host"] == pytest.approx(est.total_host, rel=1e-4, abs=64)
