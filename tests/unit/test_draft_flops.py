"""Model FLOPs of a draft-training step (models/flops.py draft_train_flops_per_token; MFU's numerator
of a `--draft.target` run): the matmul part equals what torch's FlopCounterMode counts in a real
forward + backward of GliDe and Clover training (train/glide.py) against a frozen target, with the
full and a reduced vocabulary, ce and kd; not 3x the target's forward, which a draft run reported
before (2.1-2.4x too high for a one-layer GliDe draft of SmolLM2-135M at 1K-8K tokens)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longctx.config import ModelConfig
from longctx.models.clover import CloverDraft
from longctx.models.flops import draft_train_flops_per_token, train_flops_per_token
from longctx.models.glide import GlideDraft
from longctx.models.llama import build_model
from longctx.train.glide import CloverTraining, FrozenHead, GlideTraining

CFG = ModelConfig(dim=64, layers=3, heads=4, kv_heads=2, ffn_dim=96, vocab_size=160)


@pytest.fixture(scope="module")
def frozen():
    target = build_model(CFG).requires_grad_(False).eval()
    lm_head = None if target.output is None else target.output.weight.detach()
    return target, FrozenHead(target.tok_embeddings.weight.detach(), lm_head)


@pytest.mark.parametrize("vocab", [0, 40])
@pytest.mark.parametrize("loss", ["ce", "kd"])
@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_matmul_flops_equal_a_counted_training_step(frozen, kind, loss, vocab):
    target, head = frozen
    layers, block, b, n = 2, 4, 2, 32
    draft = GlideDraft(CFG, layers, vocab) if kind == "glide" else CloverDraft(CFG, vocab)
    if vocab:
        draft.vocab.ids.copy_(torch.arange(vocab))
    model = (GlideTraining if kind == "glide" else CloverTraining)(draft, target, head, loss=loss, block=block)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, CFG.vocab_size, (b, n), generator=g) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=labels, loss_reduction="sum").backward()
    counted = counter.get_flop_counts()["Global"]
    mm = sum(f for op, f in counted.items() if str(op) in ("aten.mm", "aten.addmm"))
    # seq_len 0: the matmul part alone (the attention scores' term is linear in the length)
    formula = draft_train_flops_per_token(CFG, 0, kind=kind, layers=layers, block=block, vocab=vocab,
                                          kd=loss == "kd")
    assert mm == formula * b * n


def test_a_one_layer_draft_of_a_deep_target_costs_far_less_than_training_the_target():
    deep = ModelConfig(dim=576, layers=30, heads=9, kv_heads=3, ffn_dim=1536, vocab_size=49152)  # SmolLM2-135M
    draft = draft_train_flops_per_token(deep, 8192, kind="glide", layers=1)
    assert draft < 0.5 * train_flops_per_token(deep, 8192)  # what a draft run counted before


def test_attention_scores_grow_with_the_length_as_counted_by_hand():
    d_attn = CFG.heads * CFG.resolved_head_dim
    s = 1000
    # per token and pass: q.k and p.v over s/2 keys on average (causal, or block-stale), 2 FLOPs each
    per_pass = 2 * 2 * (s / 2) * d_attn
    glide = draft_train_flops_per_token(CFG, s, kind="glide", layers=2) - draft_train_flops_per_token(
        CFG, 0, kind="glide", layers=2)
    target_scores = CFG.layers * per_pass  # the frozen target's forward
    assert glide == pytest.approx(target_scores + 3 * 2 * (2 * per_pass))  # 2 layers: self + cross
    clover = draft_train_flops_per_token(CFG, s, kind="clover", block=3) - draft_train_flops_per_token(
        CFG, 0, kind="clover", block=3)
    assert clover == pytest.approx(target_scores + 3 * (per_pass + 3 * per_pass))  # augmenting + 3 steps
    with pytest.raises(ValueError, match="glide or clover"):
        draft_train_flops_per_token(CFG, s, kind="medusa")
