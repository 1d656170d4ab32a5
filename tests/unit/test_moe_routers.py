"""Mixture of Experts against hand-written references on small cases (models/moe.py, ops/grouped.py):
each router's choices and weights and their gradients (gate weight and input), the MoE layer
against a per-token loop (shared experts, capacity), grouped_mm against per-group matmuls, the
balancing losses against their formulas (and summed over simulated ranks), recomputation, and the
aux-loss-free bias once per optimizer step."""

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longctx.config import load_config
from longctx.models.balanced_assignment import balanced_assignment, sinkhorn
from longctx.models.moe import ROUTERS, MoEFeedForward, router_terms, update_expert_bias
from longctx.ops.grouped import grouped_mm

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


# ----------------------------------------------------------------------------------------------
# the MoE layer against a per-token loop


def make_layer(**moe):
    layer = MoEFeedForward(moe_cfg(**moe))
    gen = torch.Generator().manual_seed(1)
    for p in layer.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def swiglu(x, w1, w3, w2):
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def ref_layer(x, params, k, norm, capacity_factor=0.0, shared=False, gate=False):
    """sum over the token's kept choices of weight x SwiGLU_e(x) (+ the shared experts, gated)."""
    chosen, weights = ref_softmax(x, params["router.gate.weight"], k, norm)
    e = params["router.gate.weight"].shape[0]
    kept = [[True] * k for _ in chosen]
    if capacity_factor:  # slot 0's choices first, then slot 1's, each in token order
        cap = math.ceil(capacity_factor * len(chosen) * k / e)
        load = [0] * e
        for j in range(k):
            for t, c in enumerate(chosen):
                kept[t][j] = load[c[j]] < cap
                load[c[j]] += 1
    rows = []
    for t, row in enumerate(x):
        y = torch.zeros(DIM)
        for j, ex in enumerate(chosen[t]):
            if kept[t][j]:
                y = y + weights[t, j] * swiglu(row, params["experts.w1"][ex], params["experts.w3"][ex],
                                               params["experts.w2"][ex])
        if shared:
            s = swiglu(row, params["shared.w1.weight"], params["shared.w3.weight"], params["shared.w2.weight"])
            if gate:
                s = torch.sigmoid(params["shared_gate.weight"] @ row) * s
            y = y + s
        rows.append(y)
    return torch.stack(rows), kept


@pytest.mark.parametrize("shared,gate,capacity,norm", [
    (False, False, 0.0, True), (True, False, 0.0, False), (True, True, 0.0, True),
    (False, False, 0.5, True), (True, True, 0.75, False)])
def test_layer_matches_a_per_token_loop(shared, gate, capacity, norm):
    moe = dict(top_k=2, norm_topk=norm, capacity_factor=capacity)
    if shared:
        moe.update(shared_experts=1, shared_gate=gate)
    layer = make_layer(**moe)
    x = torch.randn(T, DIM)
    x1, x2 = leaf(x), leaf(x)
    params = {n: leaf(p) for n, p in layer.named_parameters()}
    y = layer(x1.view(2, T // 2, DIM))  # [batch, seq, dim] in, the same shape out
    ref, kept = ref_layer(x2, params, 2, norm, capacity, shared, gate)
    assert y.shape == (2, T // 2, DIM)
    torch.testing.assert_close(y.view(T, DIM), ref, rtol=1e-5, atol=1e-5)
    if capacity:
        dropped = sum(not k for row in kept for k in row)
        assert 0 < dropped < 2 * T  # the case drops some choices, not all
        # and it pins the order: token-major dropping would keep other choices
        chosen = ref_softmax(x, layer.router.gate.weight.detach(), 2, norm)[0]
        cap, load, token_major = math.ceil(capacity * T * 2 / 8), [0] * 8, []
        for c in chosen:
            token_major.append([load[e] < cap for e in c])
            for e in c:
                load[e] += 1
        assert token_major != kept
    coef = torch.randn(T, DIM)
    names = [n for n, _ in layer.named_parameters()]
    g1 = grads((y.view(T, DIM) * coef).sum(), x1, *[dict(layer.named_parameters())[n] for n in names])
    g2 = grads((ref * coef).sum(), x2, *[params[n] for n in names])
    for name, a, b in zip(["x", *names], g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


# ----------------------------------------------------------------------------------------------
# grouped_mm


@pytest.mark.parametrize("counts", [[3, 0, 2, 0, 1], [0, 6, 0, 0, 0], [1, 1, 1, 1, 2], [0, 0, 0, 0, 6]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_matches_per_group_matmuls(counts, transposed):
    n, d_in, d_out, g = sum(counts), 5, 3, len(counts)
    x = torch.randn(n, d_in)
    base = torch.randn(g, d_out, d_in) if transposed else torch.randn(g, d_in, d_out)
    b1, b2, x1, x2 = leaf(base), leaf(base), leaf(x), leaf(x)
    w1 = b1.transpose(1, 2) if transposed else b1  # as the experts pass their [E, out, in] weights
    w2 = b2.transpose(1, 2) if transposed else b2
    out = grouped_mm(x1, w1, torch.tensor(counts))
    parts, start = [], 0
    for i, c in enumerate(counts):
        parts.append(x2[start:start + c] @ w2[i])
        start += c
    ref = torch.cat(parts)
    torch.testing.assert_close(out, ref)
    coef = torch.randn(n, d_out)
    for a, b in zip(grads((out * coef).sum(), x1, b1), grads((ref * coef).sum(), x2, b2)):
        torch.testing.assert_close(a, b)
    # the weights of the empty groups get a zero gradient
    gw = grads((grouped_mm(leaf(x), w1, torch.tensor(counts)) * coef).sum(), b1)[0]
    for i, c in enumerate(counts):
        if not c:
            assert not gw[i].any()


def test_grouped_mm_with_no_rows_keeps_the_weight_in_the_graph():
    w = torch.randn(3, 4, 2, requires_grad=True)
    out = grouped_mm(torch.randn(0, 4), w, torch.tensor([0, 0, 0]))
    assert out.shape == (0, 2)
    (g,) = grads(out.sum(), w)
    assert g.shape == w.shape and not g.any()


# ----------------------------------------------------------------------------------------------
# balancing losses


def forward_recorded(layers, x):
    """The layers chained as residual branches, recording their router statistics."""
    for layer in layers:
        layer.records.clear()
        layer.recording = True
    h = x
    for layer in layers:
        h = h + layer(h)
    for layer in layers:
        layer.recording = False
    return h


def test_aux_and_z_loss_match_the_switch_formula():
    layers = [make_layer(router="switch", top_k=1), make_layer(router="switch", top_k=1)]
    layers[1].router.gate.weight.data.mul_(-1.5)  # two different routers
    x = leaf(torch.randn(T, DIM))
    forward_recorded(layers, x)
    terms = router_terms(layers, 0.7, 0.3)
    # the reference: Switch Transformer aux = E x sum_e f_e P_e (f_e the fraction of the tokens
    # routed to e, P_e the mean router probability of e); z = mean of logsumexp(logits)^2; the mean
    # over the layers; recomputed from each layer's input
    h = x
    aux, z, load = [], [], []
    for layer in layers:
        inp = h
        logits = inp @ layer.router.gate.weight.t()
        p = logits.softmax(-1)
        counts = torch.bincount(p.argmax(-1), minlength=8).float()
        f = counts / T
        aux.append(8 * (f * p.mean(0)).sum())
        z.append((torch.logsumexp(logits, -1) ** 2).mean())
        load.append(counts.max() / counts.mean())
        h = h + layer(h)
    aux, z = torch.stack(aux).mean(), torch.stack(z).mean()
    ref_loss = 0.7 * aux + 0.3 * z
    torch.testing.assert_close(terms.loss, ref_loss)
    torch.testing.assert_close(terms.stats[:4], torch.stack([aux, z, torch.stack(load).mean(),
                                                             torch.stack(load).max()]).detach())
    assert terms.stats[4] == 0  # nothing dropped
    params = [layer.router.gate.weight for layer in layers]
    for a, b in zip(grads(terms.loss, *params, x), grads(ref_loss, *params, x)):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)
    assert all(not layer.records for layer in layers)  # consumed


def test_aux_loss_of_top_k_uses_the_fraction_of_choices():
    layer = make_layer(router="softmax", top_k=2)
    x = torch.randn(T, DIM)
    forward_recorded([layer], x)
    terms = router_terms([layer], 1.0, 0.0)
    logits = x @ layer.router.gate.weight.t()
    p = logits.softmax(-1)
    f = torch.bincount(p.topk(2).indices.flatten(), minlength=8).float() / (2 * T)
    torch.testing.assert_close(terms.loss, 8 * (f * p.mean(0)).sum())
    torch.testing.assert_close(terms.counts, (f * 2 * T)[None])


def test_capacity_drops_are_counted():
    """Per layer (RouterTerms.dropped) and over the layers (stats[4]): two layers of other capacities."""
    layers = [make_layer(top_k=2, capacity_factor=0.5), make_layer(top_k=2, capacity_factor=1.0)]
    forward_recorded(layers, torch.randn(T, DIM))
    terms = router_terms(layers, 0.0, 0.0)
    want = []
    for counts, factor in zip(terms.counts, (0.5, 1.0)):
        assert counts.sum() == 2 * T  # counted before the drop
        want.append((counts - math.ceil(factor * T * 2 / 8)).clamp(min=0).sum())
    torch.testing.assert_close(terms.dropped, torch.stack(want))
    assert terms.dropped[0] > terms.dropped[1]
    torch.testing.assert_close(terms.stats[4], sum(want) / (4 * T))


@pytest.mark.parametrize("scope", ["per_layer_mean", "per_layer_sum", "pooled"])
def test_aux_loss_scopes_match_their_references(scope):
    """Three top-2 layers, their recorded routing combined by each moe.aux_loss_scope, against the
    formula written from its source: pooled = transformers' own load_balancing_loss_func on the
    layers' router logits; per_layer_sum (Megatron-LM) = the sum of the Switch losses, per_layer_mean
    their mean. The three differ on this routing, so a scope computed as another one fails."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [make_layer(top_k=2, aux_loss_scope=scope) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.router.gate.weight.data.mul_(1.0 + i)  # routers of different conviction
    x = leaf(torch.randn(T, DIM))
    forward_recorded(layers, x)
    terms = router_terms(layers, 1.0, 0.0)
    h, logits, switch = x, [], []
    for layer in layers:
        lg = h @ layer.router.gate.weight.t()
        p = lg.softmax(-1)
        f = torch.bincount(p.topk(2).indices.flatten(), minlength=8).float() / (2 * T)
        logits.append(lg)
        switch.append(8 * (f * p.mean(0)).sum())
        h = h + layer(h)
    switch = torch.stack(switch)
    ref = {"pooled": load_balancing_loss_func(tuple(logits), 8, 2), "per_layer_sum": switch.sum(),
           "per_layer_mean": switch.mean()}
    print(f"\n{scope}: {terms.loss.item():.6f} " + " ".join(f"{k} {v.item():.6f}" for k, v in ref.items()))
    torch.testing.assert_close(terms.loss, ref[scope])
    assert all(abs(terms.loss.item() - v.item()) > 1e-3 for k, v in ref.items() if k != scope)
    torch.testing.assert_close(terms.stats[0], switch.mean().detach())  # the logged figure: the mean, any scope
    params = [layer.router.gate.weight for layer in layers]
    for a, b in zip(grads(terms.loss, *params, x), grads(ref[scope], *params, x)):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scope", ["per_layer_mean", "per_layer_sum", "pooled"])
def test_shares_of_two_ranks_sum_to_the_loss_of_one_device(scope):
    """The tokens split in two calls ("ranks"), each summing its statistics with the other's through
    the hook: the shares add up to the loss of one call on all the tokens, gradients too, and both
    ranks report the single call's statistics; under every moe.aux_loss_scope."""
    layers = [make_layer(top_k=2, aux_loss_scope=scope), make_layer(top_k=2, aux_loss_scope=scope)]
    x = torch.randn(T, DIM)
    parts = [x[:10], x[10:]]  # uneven shares
    params = [layers[0].router.gate.weight, layers[1].router.gate.weight, layers[0].experts.w1]

    xs = leaf(x)
    forward_recorded(layers, xs)
    single = router_terms(layers, 1.0, 0.1)
    g_single = grads(single.loss, *params, xs)

    packed = {}
    for r, part in enumerate(parts):  # what each rank puts into the all-reduce
        forward_recorded(layers, part)
        router_terms(layers, 1.0, 0.1, lambda t, r=r: packed.setdefault(r, t.detach().clone()))
    shares, leaves = [], []
    for r, part in enumerate(parts):
        xr = leaf(part)
        leaves.append(xr)
        forward_recorded(layers, xr)
        shares.append(router_terms(layers, 1.0, 0.1, lambda t, r=r: t + packed[1 - r]))
    for s in shares:
        torch.testing.assert_close(s.stats, single.stats)
        assert torch.equal(s.counts, single.counts)
    total = shares[0].loss + shares[1].loss
    torch.testing.assert_close(total, single.loss)
    g_two_calls = grads(total, *params, *leaves)
    for a, b in zip(g_two_calls[:len(params)], g_single[:len(params)]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.cat(g_two_calls[len(params):]), g_single[-1])
    assert g_single[0].abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# recomputation, and the bias once per step


def _loss_and_grads(model, tokens):
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]) + model.router_terms().loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy,chunk", [("full", 0), ("selective", 0), ("full", 24), ("selective", 24)])
def test_recomputation_does_not_change_routing(policy, chunk):
    from longctx.memory.apply_policy import apply_memory_policy
    from longctx.models.llama import build_model

    cfg = load_config(overrides={"model": {"preset": "debug-moe"}}).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 65))
    plain = build_model(cfg, seed=3)
    loss0, g0 = _loss_and_grads(plain, tokens)
    recomputed = build_model(cfg, seed=3)
    apply_memory_policy(recomputed.layers, policy, block_chunk=chunk)
    loss1, g1 = _loss_and_grads(recomputed, tokens)
    # the same router statistics: nothing recorded twice by the recomputation, the same choices
    stats = []
    for model in (plain, recomputed):
        model(tokens[:, :-1], labels=tokens[:, 1:])
        stats.append(model.router_terms())
    assert torch.equal(stats[0].counts, stats[1].counts)
    assert g0.keys() == g1.keys()
    if chunk == 0:  # the same computation, recomputed: the same bits
        assert torch.equal(stats[0].stats, stats[1].stats)
        assert torch.equal(loss0, loss1)
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name
    else:  # the token-wise parts in chunks: the same routing, sums in another order
        torch.testing.assert_close(stats[0].stats, stats[1].stats)
        torch.testing.assert_close(loss0, loss1, rtol=1e-6, atol=1e-6)
        for name in g0:
            torch.testing.assert_close(g0[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_update_expert_bias_by_sign():
    layers = [make_layer(), make_layer()]
    counts = torch.tensor([[5.0, 1, 3, 3, 3, 3, 3, 3], [2.0, 2, 2, 2, 2, 2, 2, 2]])
    update_expert_bias(layers, counts, 0.01)
    assert layers[0].router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    assert not layers[1].router.expert_bias.any()


def test_bias_moves_once_per_optimizer_step_with_grad_accum(tmp_path):
    """grad_accum 2: the bias moves by exactly the rate per optimizer step (from the choices of both
    micro-batches), not twice the rate."""
    from longctx.models.moe import moe_layers
    from longctx.train.trainer import Trainer

    rate = 0.01
    cfg = load_config("configs/debug.toml", [
        "--model.preset=debug-moe", f"--model.moe.bias_update_rate={rate}", "--train.grad_accum=2",
        "--train.global_batch=4", "--train.seq_len=64", "--train.steps=2", "--train.eval_interval=0",
        "--data.max_docs=50", "--metrics.plots=false", "--metrics.progress=false", f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    try:
        model = trainer.model
        calls = []
        original = model.update_expert_bias
        model.update_expert_bias = lambda counts: (calls.append(counts.clone()), original(counts))
        for step in (1, 2):
            before = [layer.router.expert_bias.clone() for layer in moe_layers(model)]
            trainer.step(step)
            assert len(calls) == step  # once per optimizer step
            counts = calls[-1]
            assert (counts.sum(1) == 4 * 64 * 2).all()  # both micro-batches' choices: tokens x top_k
            for layer, b, c in zip(moe_layers(model), before, counts):
                delta = layer.router.expert_bias - b
                torch.testing.assert_close(delta, rate * torch.sign(c.mean() - c), rtol=1e-5, atol=1e-7)
                assert delta.abs().max() > 0.9 * rate
    finally:
        trainer.sampler.close()


def test_the_grouped_kernel_glue_meets_its_offsets_contract():
    """The CUDA path's glue (kernel_grouped_mm: END offsets, int32) against the loop, run through
    torch._grouped_mm on the CPU where the build allows it (fp32, 16-byte-aligned shapes), with an
    empty group, and with the experts' transposed [E, out, in] weights."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    from longctx.ops.grouped import kernel_grouped_mm

    counts = torch.tensor([24, 0, 8, 32])
    x = torch.randn(int(counts.sum()), 16)
    for w in (torch.randn(4, 16, 8), torch.randn(4, 8, 16).transpose(1, 2)):
        try:
            out = kernel_grouped_mm(x, w, counts)
        except RuntimeError as e:  # a build whose CPU kernel refuses this layout
            pytest.skip(f"torch._grouped_mm on CPU: {e}")
        torch.testing.assert_close(out, grouped_mm(x, w, counts))


def test_the_no_rows_case_still_reaches_the_input():
    """Under expert parallelism a rank may receive no rows; backward must still reach the all-to-all
    that produced them (or every other rank waits): the output is a function of x too."""
    x = torch.randn(0, 4, requires_grad=True)
    out = grouped_mm(x, torch.randn(3, 4, 2, requires_grad=True), torch.tensor([0, 0, 0]))
    (g,) = grads(out.sum(), x)
    assert g.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_grouped_kernel_matches_the_loop(monkeypatch, autocast):
    """torch._grouped_mm on the GPU (bf16) against the loop over groups on the same bf16 operands:
    outputs and the gradients of x and of the experts' transposed [E, out, in] weights, with empty
    groups. Under autocast the weights are fp32 (one GPU, no FSDP) and the kernel must still run."""
    from longctx.ops import grouped

    calls = []
    kernel = grouped.kernel_grouped_mm
    monkeypatch.setattr(grouped, "kernel_grouped_mm", lambda *a: calls.append(1) or kernel(*a))
    counts = torch.tensor([96, 0, 40, 256, 0, 8], device="cuda")
    dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=dtype)
    base = torch.randn(6, 128, 64, device="cuda", dtype=dtype) / 8  # [E, out, in], used transposed
    coef = torch.randn(x.shape[0], 128, device="cuda")

    def run(loop: bool):
        xl, bl = leaf(x), leaf(base)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if loop:
                with grouped.use_loop():
                    out = grouped_mm(xl, bl.transpose(1, 2), counts)
            else:
                out = grouped_mm(xl, bl.transpose(1, 2), counts)
        return out, grads((out.float() * coef).sum(), xl, bl)

    out, (gx, gw) = run(loop=False)
    assert calls, "the grouped kernel did not run"
    ref, (rx, rw) = run(loop=True)
    assert out.dtype == torch.bfloat16
    for got, want in ((out, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    assert not gw[1].any() and not gw[4].any()  # the empty groups' weights get a zero gradient


# ----------------------------------------------------------------------------------------------
# the dispatch's backward without a scatter-add (TokenRows)


def _dispatch_grads(tokens: int, k: int, dropped: int, device="cpu", reference=False, seed=0):
    """The gradient of a token-row gather over t x k slots sorted by a random expert choice, the
    last `dropped` sorted slots cut (a capacity): TokenRows', or index_select's autograd (reference)."""
    from longctx.models.moe import TokenRows

    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(tokens, 24, generator=gen).to(device).requires_grad_(True)
    choice = torch.randint(0, 8, (tokens * k,), generator=gen).to(device)
    order = torch.argsort(choice, stable=True)
    inverse = torch.argsort(order)
    order = order[: tokens * k - dropped]
    coef = torch.randn(order.numel(), 24, generator=gen).to(device)
    rows = flat.index_select(0, order // k) if reference else TokenRows.apply(flat, order, inverse, k)
    (g,) = grads((rows * coef).sum(), flat)
    return rows.detach(), g


@pytest.mark.parametrize("k,dropped", [(1, 0), (2, 0), (3, 0), (4, 0), (3, 17)])
def test_token_rows_gradient_is_index_selects_summed_in_slot_order(k, dropped):
    rows, g = _dispatch_grads(64, k, dropped)
    ref_rows, ref_g = _dispatch_grads(64, k, dropped, reference=True)
    assert torch.equal(rows, ref_rows)
    assert g.abs().sum() > 0
    torch.testing.assert_close(g, ref_g, rtol=1e-6, atol=1e-6)  # (only the summation order differs)
    if dropped:  # a token whose every slot was dropped gets a zero gradient, not garbage
        _, g_all = _dispatch_grads(64, k, 64 * k - 1)
        assert (g_all == 0).all(1).sum() >= 63
    assert torch.equal(_dispatch_grads(64, k, dropped)[1], g)  # bitwise, twice


def test_layer_gradients_are_the_same_bits_twice():
    """The whole layer (top-3, with and without a capacity): outputs and every gradient, bitwise."""
    def run(layer, x):
        xl = leaf(x)
        y = layer(xl)
        return [y.detach(), *grads((y * torch.linspace(-1, 1, DIM)).sum(), xl, *layer.parameters())]

    for capacity in (0.0, 0.5):
        layer, x = make_layer(top_k=3, capacity_factor=capacity), torch.randn(T, DIM)
        for a, b in zip(run(layer, x), run(layer, x)):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_dispatch_backward_is_the_same_bits_twice():
    """On CUDA: many tokens per expert at top-4, so index_add_'s atomics would collide; two runs of
    the dispatch's backward and of the layer's give the same bits, and equal index_select's to rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for dropped in (0, 1000):
        first, second = (_dispatch_grads(8192, 4, dropped, "cuda")[1] for _ in range(2))
        assert torch.equal(first, second)
        torch.testing.assert_close(first, _dispatch_grads(8192, 4, dropped, "cuda", reference=True)[1],
                                   rtol=1e-5, atol=1e-5)
    layer = make_layer(top_k=4).cuda()
    x = torch.randn(4096, DIM, device="cuda")

    def run():
        xl = leaf(x)
        y = layer(xl)
        return grads((y * y).sum(), xl, layer.router.gate.weight)

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)
