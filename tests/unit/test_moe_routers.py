"""Mixture of Experts' routers against hand-written references on small cases (models/moe.py,
models/balanced_assignment.py): each router's choices and weights and their gradients (gate weight and
input): softmax, switch, sigmoid, sinkhorn (S-BASE) and DTS-Gate.

The MoE layer against a per-token loop, grouped_mm, the dispatch's backward and recomputation are in
test_moe_grouped_mm.py; the balancing losses and the aux-loss-free bias in test_moe_router_losses.py.
Both import their shared helpers (moe_cfg, make_layer, leaf, grads, ref_softmax, ...) from here."""

import math
import threading

import pytest
import torch
from torch import nn

from longctx.config import load_config
from longctx.models.balanced_assignment import balanced_assignment, sinkhorn
from longctx.models.moe import ROUTERS, MoEFeedForward

DIM = 16
T = 24  # tokens of the small cases


def moe_cfg(**moe):
    """A validated ModelConfig: debug-moe made small (dim 16, experts of hidden size 12), moe.* on top."""
    model = {"preset": "debug-moe", "dim": DIM, "heads": 2, "kv_heads": 2, "moe.expert_dim": 12,
             **{f"moe.{k}": v for k, v in moe.items()}}
    return load_config(overrides={"model": model}).model


def make_router(**moe):
    cfg = moe_cfg(**moe)
    router = ROUTERS[cfg.moe_router](cfg)
    nn.init.normal_(router.gate.weight, std=0.5)
    return router


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def ranked(values, k):
    """The indices of the k largest values, best first (a plain sort: the reference's top-k)."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


# the MoE layer of the small cases (used by test_moe_grouped_mm.py and test_moe_router_losses.py)
def make_layer(**moe):
    layer = MoEFeedForward(moe_cfg(**moe))
    gen = torch.Generator().manual_seed(1)
    for p in layer.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


# ----------------------------------------------------------------------------------------------
# per-token references of the routers: (chosen [T][k] lists, weights [T, k] with gradient)


def ref_softmax(x, w, k, norm, scale=1.0, bias=None, temperature=1.0):
    chosen, weights = [], []
    for row in x:
        logits = (w @ row) / temperature
        p = torch.exp(logits - logits.max())
        p = p / p.sum()
        sel = (p + (0 if bias is None else bias)).tolist()
        c = ranked(sel, k)
        wt = p[c]
        if norm:  # at any k: at top-1 the weight is 1 (transformers' Mixtral, Qwen-MoE, OLMoE)
            wt = wt / wt.sum()
        chosen.append(c)
        weights.append(wt * scale)
    return chosen, torch.stack(weights)


def ref_sigmoid(x, w, k, bias, groups, topk_groups, norm, scale):
    chosen, weights = [], []
    e = w.shape[0]
    per = e // groups
    for row in x:
        s = 1 / (1 + torch.exp(-(w @ row)))
        b = (s + bias).tolist()
        group_score = [sum(sorted(b[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        best = ranked(group_score, topk_groups)
        allowed = [i for i in range(e) if i // per in best]
        c = sorted(allowed, key=lambda i: -b[i])[:k]
        wt = s[c]
        if norm:  # DeepSeek-V3: the chosen scores over their sum + 1e-20, at any k
            wt = wt / (wt.sum() + 1e-20)
        chosen.append(c)
        weights.append(wt * scale)
    return chosen, torch.stack(weights)


def check_router(router, x, ref, **ref_kwargs):
    """The router's choices, weights and their gradients (w.r.t. the gate weight and the input)
    against `ref` on copies of the same tensors; returns the router's chosen experts."""
    x1, x2 = leaf(x), leaf(x)
    w2 = leaf(router.gate.weight)
    r = router(x1)
    chosen, weights = ref(x2, w2, **ref_kwargs)
    assert r.experts.tolist() == chosen
    torch.testing.assert_close(r.weights, weights, rtol=1e-5, atol=1e-6)
    coef = torch.randn_like(weights)
    g1 = grads((r.weights * coef).sum(), router.gate.weight, x1)
    g2 = grads((weights * coef).sum(), w2, x2)
    for a, b in zip(g1, g2):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    return r.experts


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_top_k_matches_the_reference(norm):
    router = make_router(router="softmax", top_k=3, norm_topk=norm, route_scale=2.5)
    check_router(router, torch.randn(T, DIM), ref_softmax, k=3, norm=norm, scale=2.5)


def test_softmax_selection_bias_changes_the_choice_not_the_weight():
    router = make_router(router="softmax", top_k=2)
    x = torch.randn(T, DIM)
    router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    chosen = check_router(router, x, ref_softmax, k=2, norm=True, bias=router.expert_bias)
    assert chosen.tolist() != ref_softmax(x, router.gate.weight, 2, True)[0]  # the bias did change choices


def test_switch_is_top_1_weighted_by_its_probability():
    for norm in (True, False):  # the Switch Transformer's weight is p, whatever norm_topk says
        router = make_router(router="switch", top_k=1, norm_topk=norm)
        chosen = check_router(router, torch.randn(T, DIM), ref_softmax, k=1, norm=False)
        assert chosen.shape == (T, 1)
        assert (router(torch.randn(T, DIM)).weights < 0.99).all()  # p of 8 experts, never 1


@pytest.mark.parametrize("router_name", ["softmax", "sigmoid", "dts"])
def test_top_1_renormalised_weights_are_1(router_name):
    """norm_topk at top-1: the one weight over itself is 1 (times route_scale); without it, the score."""
    x = torch.randn(T, DIM)
    extra = dict(dts_steps=0) if router_name == "dts" else {}
    router = make_router(router=router_name, top_k=1, norm_topk=True, route_scale=2.5, **extra)
    torch.testing.assert_close(router(x).weights, torch.full((T, 1), 2.5), rtol=0, atol=0)
    router = make_router(router=router_name, top_k=1, norm_topk=False, **extra)
    if router_name == "sigmoid":
        check_router(router, x, ref_sigmoid, k=1, bias=torch.zeros(8), groups=1, topk_groups=1, norm=False,
                     scale=1.0)
    else:
        check_router(router, x, ref_softmax, k=1, norm=False)


def test_sigmoid_group_limited_with_a_bias():
    kw = dict(router="sigmoid", top_k=2, groups=4, topk_groups=2, route_scale=2.5)
    router = make_router(**kw)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.25, -0.3, 0.1, 0.2, -0.1])
    router.expert_bias.copy_(bias)
    x = torch.randn(64, DIM)
    ref = dict(k=2, groups=4, topk_groups=2, norm=True, scale=2.5)
    chosen = check_router(router, x, ref_sigmoid, bias=bias, **ref)
    w = router.gate.weight.detach()
    # the case exercises both: the bias and the group limit each change some tokens' choice
    assert chosen.tolist() != ref_sigmoid(x, w, bias=torch.zeros(8), **ref)[0]
    assert chosen.tolist() != ref_sigmoid(x, w, bias=bias, **dict(ref, groups=1, topk_groups=1))[0]
    # every choice lies in the token's best topk_groups groups (here: at most 2 distinct groups of 4)
    assert all(len({e // 2 for e in row}) <= 2 for row in chosen.tolist())


def test_sigmoid_without_renormalisation():
    router = make_router(router="sigmoid", top_k=3, norm_topk=False)
    router.expert_bias.copy_(torch.linspace(0.2, -0.2, 8))
    check_router(router, torch.randn(T, DIM), ref_sigmoid, k=3, bias=router.expert_bias, groups=1,
                 topk_groups=1, norm=False, scale=1.0)


# ----------------------------------------------------------------------------------------------
# sinkhorn (S-BASE)


def test_sinkhorn_normalises_rows_and_columns():
    logits = torch.randn(12, 4) * 2
    p = torch.exp(logits)
    for _ in range(30):
        p = p / p.sum(0, keepdim=True) * (12 / 4)
        p = p / p.sum(1, keepdim=True)
    torch.testing.assert_close(sinkhorn(logits, 30).exp(), p, rtol=1e-4, atol=1e-6)
    q = sinkhorn(logits, 30).exp()
    torch.testing.assert_close(q.sum(1), torch.ones(12))
    torch.testing.assert_close(q.sum(0), torch.full((4,), 3.0), rtol=1e-3, atol=1e-3)


def test_balanced_assignment_on_hand_made_scores():
    # every token prefers expert 0; capacity 2 = ceil(4 x 1 / 2): it keeps its two keenest tokens
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.5], [0.7, 0.2], [0.95, 0.3]])
    assert balanced_assignment(scores, 1).flatten().tolist() == [0, 1, 1, 0]
    # top-2 of 2 experts: each takes every token (capacity 4 = ceil(4 x 2 / 2)); slot 0 is each
    # token's best while room lasts
    assert balanced_assignment(scores, 2).tolist() == [[0, 1]] * 4
    # without contention every token gets its own best, in preference order
    free = torch.eye(4).repeat(2, 1) + torch.linspace(0, 0.1, 4)
    assert balanced_assignment(free, 2)[:, 0].tolist() == [0, 1, 2, 3] * 2


def assert_balanced(chosen, tokens, experts, k):
    assert chosen.shape == (tokens, k)
    assert all(len(set(row)) == k for row in chosen.tolist()), "a token got the same expert twice"
    load = torch.bincount(chosen.flatten(), minlength=experts)
    # within one choice of an even share T k / E: every expert takes its floor or its ceiling
    assert load.max() <= math.ceil(tokens * k / experts) and load.min() >= tokens * k // experts, load.tolist()


def _in_thread(fn, timeout=60.0):
    """fn() with a time limit: a balanced assignment that never ends fails here instead of hanging."""
    out = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(timeout)
    assert out, f"did not finish within {timeout:.0f}s"
    return out[0]


@pytest.mark.parametrize("tokens,experts,k", [(13, 8, 2), (16, 4, 2), (13, 4, 1), (7, 4, 3), (5, 4, 4), (64, 8, 2)])
def test_sinkhorn_router_is_balanced(tokens, experts, k):
    router = make_router(router="sinkhorn", experts=experts, top_k=k).train()
    # identical logits for every token (the uniform case: every token wants the same experts)
    same = torch.randn(1, DIM).expand(tokens, DIM)
    assert_balanced(_in_thread(lambda: router(same).experts), tokens, experts, k)
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + k)
    for scale in (0.1, 1.0, 5.0):  # random logits, from near-uniform to peaked
        for _ in range(10):
            x = torch.randn(tokens, DIM, generator=gen) * scale
            assert_balanced(_in_thread(lambda x=x: router(x).experts), tokens, experts, k)


def test_balanced_assignment_cases_that_used_to_hang():
    """16 tokens, 4 experts, top-2: the slot-by-slot greedy could leave a token with only full
    experts it did not hold, and loop forever (or hand it an expert twice)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = sinkhorn(torch.randn(16, 4, generator=gen) * 2, 8)
        assert_balanced(_in_thread(lambda s=scores: balanced_assignment(s, 2)), 16, 4, 2)


def test_sinkhorn_weights_and_gradients():
    router = make_router(router="sinkhorn", top_k=2).train()
    x = torch.randn(T, DIM)
    assigned = router(x).experts.tolist()

    def ref(x, w, **_):  # the router's assignment (checked above); weights: renormalised softmax probabilities
        logits = x @ w.t()
        p = torch.exp(logits - logits.max(1, keepdim=True).values)
        p = p / p.sum(1, keepdim=True)
        wt = p.gather(1, torch.tensor(assigned))
        return assigned, wt / wt.sum(1, keepdim=True)

    check_router(router, x, ref)
    # the balanced assignment differs from plain top-k here (it does something)
    assert assigned != ref_softmax(x, router.gate.weight, 2, True)[0]


def test_sinkhorn_in_evaluation_is_plain_top_k():
    router = make_router(router="sinkhorn", top_k=2).eval()
    check_router(router, torch.randn(T, DIM), ref_softmax, k=2, norm=True)


# ----------------------------------------------------------------------------------------------
# DTS-Gate


def test_dts_schedule():
    router = make_router(router="dts", top_k=2, dts_steps=10, dts_temperature=2.0)
    assert router.schedule(0) == (2.0, 8)
    t, k = router.schedule(3)
    assert math.isclose(t, 1.7) and k == 6  # round(8 - 6 x 0.3)
    t, k = router.schedule(5)
    assert math.isclose(t, 1.5) and k == 5
    assert router.schedule(10) == (1.0, 2)
    assert router.schedule(25) == (1.0, 2)


def test_dts_is_dense_at_step_0_and_top_k_after_its_steps():
    router = make_router(router="dts", top_k=2, dts_steps=10, dts_temperature=2.0).train()
    x = torch.randn(T, DIM)
    router.step = 0
    chosen = check_router(router, x, ref_softmax, k=8, norm=True, temperature=2.0)
    r = router(x)
    assert sorted(chosen[0].tolist()) == list(range(8)) and (r.weights > 0).all()  # every expert, weighted
    torch.testing.assert_close(r.weights.sum(1), torch.ones(T))
    router.step = 5
    check_router(router, x, ref_softmax, k=5, norm=True, temperature=1.5)
    for step in (10, 11):
        router.step = step
        assert check_router(router, x, ref_softmax, k=2, norm=True).shape == (T, 2)



def test_dts_evaluates_as_it_trains_at_that_step():
    """moe.dts_eval = schedule (the default): evaluation routes as training at the router's step,
    warm-up included; top_k: top-k at temperature 1 whatever the step. With no step set (a model
    built outside a run) evaluation routes as the schedule ends."""
    x = torch.randn(T, DIM)
    router = make_router(router="dts", top_k=2, dts_steps=10, dts_temperature=2.0).eval()
    for step, k, temperature in ((0, 8, 2.0), (5, 5, 1.5), (12, 2, 1.0)):
        router.step = step
        check_router(router, x, ref_softmax, k=k, norm=True, temperature=temperature)
    assert router.describe_eval() == "dts routing as its schedule ends (2 experts per token, temperature 1.00)"
    router.step = 5
    assert router.describe_eval() == "dts routing as training at step 6 (5 experts per token, temperature 1.50)"
    router.step = None
    check_router(router, x, ref_softmax, k=2, norm=True)
    top = make_router(router="dts", top_k=2, dts_steps=10, dts_temperature=2.0, dts_eval="top_k").eval()
    top.step = 5
    check_router(top, x, ref_softmax, k=2, norm=True)
    assert top.describe_eval() == "dts routing as its schedule ends (2 experts per token, temperature 1.00)"
    top.train()  # training follows the schedule under either setting
    check_router(top, x, ref_softmax, k=5, norm=True, temperature=1.5)


def test_dts_model_evaluation_equals_its_training_forward_in_the_warm_up():
    """A DTS model at step 3 of 10: its evaluation's loss is the training forward's (the same routing),
    not the loss of top-k routing it was never trained with (moe.dts_eval = top_k)."""
    from longctx.models.llama import build_model
    from longctx.models.moe_eval_routing import eval_routing_note

    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = {}
    for mode in ("schedule", "top_k"):
        cfg = load_config(overrides={"model": {"preset": "debug-moe", "layers": 2, "moe.router": "dts",
                                               "moe.dts_steps": 10, "moe.dts_eval": mode}}).model
        model = build_model(cfg, seed=3)
        with torch.no_grad():  # experts of some weight in the output (the init's are tiny)
            for name, p in model.named_parameters():
                if ".experts." in name or "router.gate" in name:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        model.set_router_step(3)
        with torch.no_grad():
            train_loss = model.train()(tokens[:, :-1], labels=tokens[:, 1:])
            losses[mode] = model.eval()(tokens[:, :-1], labels=tokens[:, 1:])
        if mode == "schedule":
            assert losses[mode] == train_loss
            assert eval_routing_note(model) == ("dts routing as training at step 4 (6 experts per token, "
                                                "temperature 1.70)")
    assert abs(losses["top_k"] - losses["schedule"]) > 1e-3
