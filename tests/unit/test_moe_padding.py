"""Padding (a packed sample's tokens past its documents: pad token EOS, a document of its own, positions
from 0, no labels) is no token of the micro-batch for the MoE layers: the loader's `real` mask (Batch.real)
keeps it out of the router statistics (choices per expert, probability sums, z-loss, token count) and,
with a capacity, out of the experts' queues and the capacity's N (its choices are never kept: it passes
through the residual). So a padded call routes its real tokens, drops their choices and records the same
statistics as the call without the padding; and a batch without padding is bit-identical with or without
a mask. (Before: the padding tokens, identical inputs, all queued first for one expert and took its slots
ahead of real tokens' later choices, and counted in every statistic.)"""

import copy

import numpy as np
import pytest
import torch

from longctx.config import load_config
from longctx.data.loader import PackedSamples
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model
from longctx.models.moe import MoEFeedForward, moe_layers, router_terms

EOS, SEQ, REAL0 = 257, 128, 80  # row 0: 80 real tokens and 48 of padding; row 1: all real
ROUTERS = {"softmax-capacity": {"capacity_factor": 1.0}, "sigmoid-capacity": {"router": "sigmoid",
           "capacity_factor": 1.25}, "softmax": {}, "sinkhorn": {"router": "sinkhorn"}}


def _cfg(moe: dict):
    return load_config(overrides=["--model.preset=debug-moe", *(f"--model.moe.{k}={v}" for k, v in moe.items())])


def _skew(model):  # two experts take most first choices: the capacity binds hard
    for layer in moe_layers(model):
        layer.router.expert_bias.copy_(torch.tensor([0.06, 0.03, 0, 0, 0, 0, 0, 0]))
    return model


def _layer(moe: dict) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(_cfg(moe).model)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.router.expert_bias.copy_(torch.tensor([0.3, 0.15, 0, 0, 0, 0, 0, 0]))
    return layer.train()


def _tokens(dim: int):
    """[1, 2 x SEQ, dim] hidden states of two rows, row-major; row 0 ends in REAL0 .. SEQ padding (one vector,
    as identical inputs give), and the [2 x SEQ] real mask."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, SEQ, dim, generator=g)
    x[0, REAL0:] = torch.randn(dim, generator=g) + 2.0
    real = torch.ones(2, SEQ, dtype=torch.bool)
    real[0, REAL0:] = False
    return x.reshape(1, 2 * SEQ, dim), real.reshape(-1)


def _call(layer, x, real):
    layer.records.clear()
    layer.recording, layer.real = True, real
    out = layer(x)
    rec = layer.records[-1]
    kept = layer.route(x[0]).kept
    layer.real = None
    return out, rec, kept


@pytest.mark.parametrize("router", list(ROUTERS))
def test_a_padded_call_routes_and_records_as_the_call_without_its_padding(router):
    layer = _layer(ROUTERS[router])
    x, real = _tokens(layer.router.gate.in_features)
    out, rec, kept = _call(layer, x, real)
    ref_out, ref, ref_kept = _call(layer, x[:, real], None)
    assert torch.equal(rec.counts, ref.counts), (rec.counts, ref.counts)
    assert torch.equal(rec.dropped, ref.dropped)
    assert float(rec.tokens) == ref.tokens == int(real.sum())
    torch.testing.assert_close(rec.prob_sum, ref.prob_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rec.lse_sq_sum, ref.lse_sq_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, real], ref_out, rtol=1e-5, atol=1e-6)
    if router == "sinkhorn":  # the padding is no part of the balanced assignment, and is not kept
        assert torch.equal(kept, real[:, None].expand_as(kept)) and ref_kept is None
        assert torch.equal(out[:, ~real], torch.zeros_like(out[:, ~real]))
    if "capacity" in router:
        assert ref.dropped > 0  # (the capacity binds)
        assert torch.equal(kept[real], ref_kept)  # the real tokens keep what they keep without the padding
        assert not kept[~real].any()  # the padding is never kept: through the residual only
        assert torch.equal(out[:, ~real], torch.zeros_like(out[:, ~real]))
    layer.records = [rec]
    terms = router_terms([layer], 0.01, 0.001)
    layer.records = [ref]
    ref_terms = router_terms([layer], 0.01, 0.001)
    torch.testing.assert_close(terms.stats, ref_terms.stats, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms.loss, ref_terms.loss, rtol=1e-5, atol=1e-7)


def _batch(vocab: int, pad: bool = True):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = torch.randint(0, vocab, (2, SEQ), generator=g)
    doc = torch.stack([(torch.arange(SEQ) >= 40).long(), (torch.arange(SEQ) >= 70).long()])
    starts = (torch.tensor([0, 40]), torch.tensor([0, 70]))
    pos = torch.stack([torch.arange(SEQ) - starts[r][doc[r]] for r in range(2)])
    real = torch.ones(2, SEQ, dtype=torch.bool)
    if pad:  # as the loader pads: EOS, a document of its own, positions from 0, no labels
        real[0, REAL0:] = False
        tokens[0, REAL0:], doc[0, REAL0:], labels[0, REAL0 - 1:] = EOS, 2, -100
        pos[0, REAL0:] = torch.arange(SEQ - REAL0)
    labels[:, :-1][doc[:, 1:] != doc[:, :-1]] = -100
    return tokens, pos, doc, labels, real


def _step(model, tokens, pos, doc, labels, real):
    loss = model(tokens, pos, doc, labels=labels, loss_reduction="sum", **({} if real is None else {"real": real}))
    terms = model.router_terms()
    (loss + terms.loss).backward()
    return loss.detach(), terms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_without_padding_a_mask_changes_no_bit():
    cfg = _cfg({"capacity_factor": 1.0})
    model = _skew(build_model(cfg.model, seed=3).train())
    batch = _batch(cfg.model.vocab_size, pad=False)
    loss0, terms0, grads0 = _step(copy.deepcopy(model), *batch[:4], None)
    loss1, terms1, grads1 = _step(copy.deepcopy(model), *batch)
    assert terms0.dropped.sum() > 0
    assert torch.equal(loss0, loss1) and torch.equal(terms0.loss, terms1.loss)
    assert torch.equal(terms0.stats, terms1.stats) and torch.equal(terms0.counts, terms1.counts)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_the_model_leaves_padding_out_of_statistics_and_drops():
    """Each layer's records with the mask equal those of its call on the real tokens alone (the padding's
    hidden states never reach a real token: a document of its own), and the padding drops nothing real."""
    cfg = _cfg({"capacity_factor": 1.0})
    model = _skew(build_model(cfg.model, seed=3).train())
    tokens, pos, doc, labels, real = _batch(cfg.model.vocab_size)
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().clone())) for m in moe_layers(model)]
    model(tokens, pos, doc, labels=labels, loss_reduction="sum", real=real)
    for h in hooks:
        h.remove()
    records = [layer.records[-1] for layer in moe_layers(model)]
    for layer, x, rec in zip(moe_layers(model), inputs, records):
        layer.records.clear()
        _, ref, _ = _call(layer, x.reshape(1, -1, x.shape[-1])[:, real.flatten()], None)
        assert torch.equal(rec.counts, ref.counts) and torch.equal(rec.dropped, ref.dropped)
        assert float(rec.tokens) == ref.tokens
        torch.testing.assert_close(rec.prob_sum, ref.prob_sum, rtol=1e-5, atol=1e-5)
    assert sum(float(r.dropped) for r in records) > 0


def test_pieces_see_the_padding_as_the_whole_call():
    cfg = _cfg({"capacity_factor": 1.0})
    model = _skew(build_model(cfg.model, seed=3).train())
    batch = _batch(cfg.model.vocab_size)
    loss0, terms0, grads0 = _step(copy.deepcopy(model), *batch)
    chunked = copy.deepcopy(model)
    apply_memory_policy(chunked.layers, "selective", block_chunk=48)
    loss1, terms1, grads1 = _step(chunked, *batch)
    assert torch.equal(terms0.counts, terms1.counts) and torch.equal(terms0.dropped, terms1.dropped)
    torch.testing.assert_close(terms1.stats, terms0.stats, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-5)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-5)


def test_the_loader_marks_padding(tmp_path):
    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store

    d = tmp_path / "in"
    d.mkdir()
    for name, text in (("a", "hello"), ("b", "abc"), ("c", "xyzxyzxyz")):
        (d / f"{name}.txt").write_text(text)
    build_store(BuildOptions([str(d)], str(tmp_path / "s"), 12, strategy="bfd", dedup="none", workers=1,
                             progress=False, stats=False), log=lambda *_: None)
    samples = PackedSamples(tmp_path / "s")
    b = samples.batch([0, 1])
    assert b.real.dtype == torch.bool
    for row in range(2):  # real tokens first, then the padding (its own document id, no labels)
        n = int(samples.real_tokens[row])
        assert b.real[row].tolist() == [True] * n + [False] * (12 - n)
    held = np.array([[11, 0, 5], [2, 10, 7]])
    part = samples.read_at([0, 1], samples.frames([0, 1]), held)
    assert torch.equal(part.real, b.real.gather(1, torch.from_numpy(held)))
