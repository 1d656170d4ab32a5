"""MoE routing that looks across the tokens of a call (a capacity: which choices are dropped; the
Sinkhorn router's balanced assignment) under the memory policies that run a block's token-wise parts
in pieces (memory.block_chunk, and the token-split offload: memory/apply_policy.py `_in_parts`): the
pieces are routed as one call, so the loss, the router statistics (choices per expert, drops) and
every gradient equal the unsplit model's, in training and in evaluation (fp32, one process)."""

import copy

import pytest
import torch

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model

ROUTERS = {  # the routings whose choice for a token depends on the call's other tokens
    "softmax-capacity": {"capacity_factor": 1.0},
    "switch-capacity": {"router": "switch", "top_k": 1, "capacity_factor": 1.0, "norm_topk": False},
    "sigmoid-capacity": {"router": "sigmoid", "capacity_factor": 1.25},
    "sinkhorn": {"router": "sinkhorn"},
}
# (recompute, offload fraction, block chunk) over 2 x 128 tokens: 4 chunks, uneven chunks, the
# stored / recomputed split of the offload alone and with chunks
POLICIES = [("selective", 0.0, 64), ("full", 0.0, 64), ("selective", 0.0, 96), ("selective", 0.5, 0),
            ("selective", 0.3, 48), ("full", 0.5, 40)]


def _model(moe: dict):
    cfg = load_config(overrides=["--model.preset=debug-moe", *(f"--model.moe.{k}={v}" for k, v in moe.items())]).model
    return build_model(cfg, seed=0)


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 320, (2, 129), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(model, tokens, labels):
    loss = model(tokens, labels=labels)
    terms = model.router_terms()
    (loss + terms.loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), terms, grads


@pytest.fixture(scope="module", params=list(ROUTERS))
def reference(request):
    model = _model(ROUTERS[request.param]).train()
    tokens, labels = _batch()
    return request.param, model, _run(copy.deepcopy(model), tokens, labels)


@pytest.mark.parametrize("policy,fraction,chunk", POLICIES)
def test_pieces_route_as_one_call(reference, policy, fraction, chunk):
    name, base, (loss0, terms0, grads0) = reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    loss1, terms1, grads1 = _run(model, *_batch())
    # the same decisions: choices per expert and drops exactly (a per-piece capacity drops ~2x more at 4 pieces)
    assert torch.equal(terms0.counts, terms1.counts), name
    assert torch.equal(terms0.dropped, terms1.dropped), name
    if "capacity" in name:
        assert terms0.dropped.sum() > 0  # (the capacity binds: the test sees its decisions)
    torch.testing.assert_close(terms1.stats, terms0.stats)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys()
    for key in grads0:
        torch.testing.assert_close(grads1[key], grads0[key], rtol=1e-4, atol=1e-6, msg=key)


def test_evaluation_with_a_capacity_routes_as_one_call():
    base = _model(ROUTERS["softmax-capacity"]).eval()
    tokens, labels = _batch()
    chunked = copy.deepcopy(base)
    apply_memory_policy(chunked.layers, "selective", block_chunk=64)
    with torch.no_grad():
        torch.testing.assert_close(chunked(tokens, labels=labels), base(tokens, labels=labels), rtol=1e-6, atol=1e-6)


def test_the_first_pass_neither_dispatches_nor_records():
    """The pass that gathers the call's routing runs no expert (so, under expert parallelism, no
    exchange: every rank's pieces meet their experts exactly as without it) and records no statistic;
    afterwards no layer is left in a call's pieces."""
    from longctx.models.moe import moe_layers

    base = _model(ROUTERS["softmax-capacity"]).train()
    calls = []
    for layer in moe_layers(base):
        dispatch = layer.dispatcher.dispatch
        layer.dispatcher.dispatch = lambda flat, routing, dispatch=dispatch: (calls.append(flat.shape[0]),
                                                                              dispatch(flat, routing))[1]
    apply_memory_policy(base.layers, "selective", block_chunk=64)
    tokens, labels = _batch()
    base(tokens, labels=labels)
    assert calls == [64] * 4 * len(moe_layers(base))  # one dispatch per piece: 4 pieces of 64 per layer
    assert sum(len(layer.records) for layer in moe_layers(base)) == 4 * len(moe_layers(base))
    assert all(layer.pieces is None for layer in moe_layers(base))
