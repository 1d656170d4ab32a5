"""models/flops.py against torch's own FlopCounterMode on a real forward + backward of small models: dense,
grouped-query, Mixture of Experts (the router gate, top_k routed experts and the gated shared expert a token goes
through: active experts only) with a dense first layer. The convention (models/flops.py's docstring): training is
3x forward; the attention-score term is halved under the causal mask (FlopCounterMode counts the full S x S
matmuls, so causal=False must equal its count and causal=True the count less half the scores), and packed
documents are counted as one causal sequence of seq_len, an upper bound on their sum of len_i^2 (MFU is then an
upper bound). The experts run through the grouped loop (ops/grouped.py use_loop), whose matmuls the counter sees
(torch._grouped_mm it does not count)."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longctx.config import load_config
from longctx.models import flops
from longctx.models.llama import build_model
from longctx.ops.grouped import use_loop

B, S = 2, 32


def _full_scores_core(q, k, v, doc_ids):
    """Attention with every S x S score computed (masked after), as a plain kernel counts it."""
    s, g = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    hidden = torch.ones(s, s, dtype=torch.bool).triu(1)
    if doc_ids is not None:
        hidden = hidden | (doc_ids[:, None, :, None] != doc_ids[:, None, None, :])
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _counted(over, doc_ids=None):
    """(config, matmul FLOPs, attention-score FLOPs) FlopCounterMode counts for one training step."""
    cfg = load_config(overrides=["--model.preset=debug", *over]).model
    model = build_model(cfg, "cpu").train()
    for block in model.layers:
        block.attention.core = _full_scores_core
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(S).expand(B, S)
    with use_loop(), FlopCounterMode(display=False) as counter:
        model(tokens, positions, doc_ids, labels=tokens).backward()
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.bmm", "aten.addmm"}, ops
    return cfg, ops.get("aten.mm", 0) + ops.get("aten.addmm", 0), ops.get("aten.bmm", 0)


MODELS = {
    "dense": [],
    "gqa": ["--model.kv_heads=1", "--model.head_dim=48"],
    "moe": ["--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.dense_layers=0"],
    "moe-shared": ["--model.moe.experts=4", "--model.moe.top_k=1", "--model.moe.shared_experts=1",
                   "--model.moe.shared_gate=true", "--model.moe.expert_dim=64"],
}


@pytest.mark.parametrize("name", MODELS)
def test_flops_per_token_are_what_a_training_step_counts(name):
    cfg, matmul, scores = _counted(MODELS[name])
    tokens, d_attn = B * S, cfg.heads * cfg.resolved_head_dim
    assert scores == 3 * cfg.layers * B * 4 * S * S * d_attn  # (the counter's own figure: the full S x S)
    assert 3 * flops.forward_matmul_flops_per_token(cfg) * tokens == matmul
    assert flops.train_flops_per_token(cfg, S, causal=False) * tokens == matmul + scores
    assert flops.train_flops_per_token(cfg, S) * tokens == matmul + scores / 2


def test_moe_counts_the_active_experts_only():
    _, dense_mm, _ = _counted([])
    cfg, moe_mm, _ = _counted(["--model.moe.experts=8", "--model.moe.top_k=2"])
    expert = 3 * 2 * 3 * cfg.dim * cfg.resolved_expert_dim * B * S  # train x FLOPs/param x w1,w2,w3
    gate = 3 * 2 * cfg.dim * cfg.moe_experts * B * S
    # (8 experts of ffn_dim; a token goes through two of them and the gate: the dense MLP's count twice, plus it)
    assert moe_mm - dense_mm == cfg.layers * (2 * expert - expert + gate)
    assert flops.train_flops_per_token(cfg, S) - flops.train_flops_per_token(load_config(
        overrides=["--model.preset=debug"]).model, S) == (moe_mm - dense_mm) / (B * S)


def test_packed_documents_are_counted_as_one_causal_sequence_an_upper_bound():
    lengths = (20, 8, 4)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(B, S)
    cfg, matmul, _ = _counted([], doc_ids)
    d_attn = cfg.heads * cfg.resolved_head_dim
    # what the documents' causal attention needs: each one's len^2 / 2 scores, not the row's S^2 / 2
    needed = matmul + 3 * cfg.layers * B * 4 * sum(n * n for n in lengths) * d_attn / 2
    counted = flops.train_flops_per_token(cfg, S) * B * S
    assert counted == matmul + 3 * cfg.layers * B * 4 * S * S * d_attn / 2  # (the documented convention)
    assert counted > needed
