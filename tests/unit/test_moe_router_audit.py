"""An audit of the MoE routers against float64 references written here from the papers and transformers
(models/moe.py): every router kind's choices, weights, balancing probabilities and router gradients (ties,
k = 1, k = E, groups = 1); DeepSeek-V3's router against transformers'; a cast of the model keeping the
router fp32. The balancing half of the audit (losses, capacity, bias update, metrics) is
test_moe_router_audit2.py, which imports the reference router (ref_route) and the helpers from here."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import ROUTERS, MoEFeedForward, moe_layers

DIM = 16


def moe_cfg(dim=DIM, **moe):
    model = {"preset": "debug-moe", "dim": dim, "heads": 2, "kv_heads": 2, "moe.expert_dim": 8,
             **{f"moe.{k}": v for k, v in moe.items()}}
    return load_config(overrides={"model": model}).model


def make_layer(seed=0, dim=DIM, **moe):
    layer = MoEFeedForward(moe_cfg(dim, **moe))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    return layer


def tokens(n, dim=DIM, seed=1):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def best(values, k):
    """Indices of the k largest values, best first, ties to the lower index (a plain sort)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


# ----------------------------------------------------------------------------------------------
# the routers' reference, float64: (chosen [T][k], weights [T, k], probs [T, E], logits [T, E])


def ref_route(kind, x, w, *, k, bias=None, norm=True, scale=1.0, groups=1, topk_groups=1, temperature=1.0):
    e = w.shape[0]
    bias = torch.zeros(e, dtype=torch.float64) if bias is None else bias.double()
    logits = x.double() @ w.double().t()
    if kind == "sigmoid":  # DeepSeek-V3
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
        select, gathered = scores + bias, scores
    else:
        probs = torch.softmax(logits / temperature, -1)
        select, gathered = probs + bias, probs
    chosen = []
    per = e // groups
    for row in select.detach().tolist():
        allowed = range(e)
        if groups > 1:  # a group's score: its two best biased scores
            gs = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
            keep = best(gs, topk_groups)
            allowed = [i for i in range(e) if i // per in keep]
        vals = [row[i] if i in allowed else -math.inf for i in range(e)]
        chosen.append(best(vals, k))
    wt = torch.stack([gathered[t, c] for t, c in enumerate(chosen)])
    if norm and kind != "switch":
        wt = wt / (wt.sum(-1, keepdim=True) + (1e-20 if kind == "sigmoid" else 0.0))
    return chosen, wt * scale, probs, logits


CASES = {
    "softmax-k2-norm-bias": dict(router="softmax", experts=8, top_k=2, norm_topk=True, bias=True),
    "softmax-k3-nonorm-scale": dict(router="softmax", experts=8, top_k=3, norm_topk=False, route_scale=2.5,
                                    bias=True),
    "softmax-k1-norm": dict(router="softmax", experts=4, top_k=1, norm_topk=True),
    "softmax-k1-nonorm": dict(router="softmax", experts=16, top_k=1, norm_topk=False),
    "softmax-k=E": dict(router="softmax", experts=8, top_k=8, norm_topk=True),
    "switch": dict(router="switch", experts=8, top_k=1, norm_topk=True, route_scale=1.5),
    "sigmoid-groups-bias-scale": dict(router="sigmoid", experts=16, top_k=4, groups=4, topk_groups=2,
                                      route_scale=2.5, bias=True),
    "sigmoid-groups1-nonorm": dict(router="sigmoid", experts=8, top_k=2, norm_topk=False, bias=True),
    "sigmoid-k=E": dict(router="sigmoid", experts=8, top_k=8, groups=2, topk_groups=2),
    "sigmoid-k1-groups8": dict(router="sigmoid", experts=16, top_k=1, groups=8, topk_groups=3, bias=True),
    "sinkhorn-eval": dict(router="sinkhorn", experts=8, top_k=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_router_matches_its_float64_reference(name):
    """Choices (in slot order), weights, the balancing loss's probabilities and the logits, and the gate's
    gradient through the combine weights, for every router kind the config offers."""
    case = dict(CASES[name])
    with_bias = case.pop("bias", False)
    cfg = moe_cfg(**case)
    router = ROUTERS[cfg.moe_router](cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(router.gate.weight.shape, generator=gen) * 0.6)
        if with_bias:
            router.expert_bias.copy_(torch.randn(cfg.moe_experts, generator=gen) * 0.05)
    router.eval() if cfg.moe_router == "sinkhorn" else router.train()
    x = tokens(96)
    r = router(x)
    w64 = router.gate.weight.detach().double().requires_grad_(True)
    chosen, wt, probs, logits = ref_route(cfg.moe_router, x, w64, k=cfg.moe_top_k, bias=router.expert_bias,
                                          norm=cfg.moe_norm_topk, scale=cfg.moe_route_scale, groups=cfg.moe_groups,
                                          topk_groups=cfg.moe_topk_groups)
    assert r.experts.tolist() == chosen
    torch.testing.assert_close(r.weights.double(), wt.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(r.probs.double(), probs.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(r.logits.double(), logits.detach(), rtol=2e-6, atol=1e-6)
    coef = torch.randn(wt.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((r.weights.double() * coef).sum(), router.gate.weight)
    (g_ref,) = torch.autograd.grad((wt * coef).sum(), w64)
    if cfg.moe_top_k == 1 and cfg.moe_norm_topk and cfg.moe_router != "switch":
        assert g_ref.abs().max() < 1e-12  # every weight is 1
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_deepseek_v3_router_matches_transformers():
    """The sigmoid router (bias for the selection only, groups by their two best biased scores,
    routed_scaling_factor) against transformers' DeepseekV3TopkRouter on the same weights and bias."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = moe_cfg(dim=32, router="sigmoid", experts=16, top_k=4, groups=4, topk_groups=2, route_scale=2.5)
    router = ROUTERS["sigmoid"](cfg)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                               n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                               norm_topk_prob=True))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(16, 32, generator=gen) * 0.3)
        router.expert_bias.copy_(torch.randn(16, generator=gen) * 0.1)
        hf.weight.copy_(router.gate.weight)
        hf.e_score_correction_bias.copy_(router.expert_bias)
    x = tokens(128, 32)
    r = router(x)
    _, hf_w, hf_idx = hf(x)
    order = hf_idx.argsort(-1)  # transformers' top-k is unsorted: compare each token's choices as a set
    ours = r.experts.argsort(-1)
    assert torch.equal(r.experts.gather(1, ours), hf_idx.gather(1, order))
    torch.testing.assert_close(r.weights.gather(1, ours), hf_w.gather(1, order))
    unbiased = ref_route("sigmoid", x, router.gate.weight, k=4, groups=4, topk_groups=2)[0]
    assert unbiased != r.experts.tolist()  # (the bias moves choices here: the case checks where it enters)


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "dts"])
def test_the_bias_moves_the_choice_never_the_weight(router):
    """A large bias on one expert puts it in every token's choices; its weight is still its unbiased score."""
    case = dict(router=router, experts=8, top_k=2)
    cfg = moe_cfg(**case)
    r = ROUTERS[router](cfg).train()
    r.step = 10 ** 6  # dts: past its schedule (top-k at temperature 1)
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(8, DIM, generator=torch.Generator().manual_seed(0)))
        r.expert_bias[5] = 10.0
    x = tokens(64)
    out = r(x)
    assert (out.experts == 5).any(-1).all()
    chosen, wt, _, _ = ref_route("sigmoid" if router == "sigmoid" else "softmax", x, r.gate.weight, k=2,
                                 bias=r.expert_bias)
    assert out.experts.tolist() == chosen
    torch.testing.assert_close(out.weights.double(), wt.detach(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("router", ["softmax", "switch", "sigmoid", "dts"])
def test_ties_give_distinct_experts_and_the_tied_weights(router):
    """A gate of zeros: every score ties. Each token still gets k distinct experts, with weight 1 / k
    renormalised (softmax, sigmoid: 0.5 / (k x 0.5)), 1 / E for switch (its probability); and with two
    identical gate rows the two tied experts get equal weights whichever of them is taken first."""
    k = 1 if router == "switch" else 3
    cfg = moe_cfg(router=router, experts=8, top_k=k, groups=2 if router == "sigmoid" else 1,
                  topk_groups=2 if router == "sigmoid" else 1)
    r = ROUTERS[router](cfg).train()
    r.step = 10 ** 6
    with torch.no_grad():
        r.gate.weight.zero_()
    out = r(tokens(64))
    assert all(len(set(row)) == k for row in out.experts.tolist())
    want = 1 / 8 if router == "switch" else 1 / k
    torch.testing.assert_close(out.weights, torch.full_like(out.weights, want))
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(8, DIM, generator=torch.Generator().manual_seed(3)))
        r.gate.weight[4] = r.gate.weight[1]
    x = tokens(64, seed=4)
    out = r(x)
    kind = "sigmoid" if router == "sigmoid" else ("switch" if router == "switch" else "softmax")
    chosen, wt, _, _ = ref_route(kind, x, r.gate.weight, k=k, groups=cfg.moe_groups, topk_groups=cfg.moe_topk_groups)
    for t, (row, ref_row) in enumerate(zip(out.experts.tolist(), chosen)):
        canon = [1 if e == 4 else e for e in row]  # experts 1 and 4 are the same expert
        ref_canon = [1 if e == 4 else e for e in ref_row]
        assert sorted(canon) == sorted(ref_canon), t
        got = sorted(out.weights[t].tolist())
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), wt[t].detach().sort().values,
                                   rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("step,temperature,k", [(0, 2.0, 8), (3, 1.5, 5), (6, 1.0, 2), (9, 1.0, 2)])
def test_dts_routes_as_its_schedule_says(step, temperature, k):
    """DTS-Gate (docs/moe.md): every expert at dts_temperature at step 0, annealed linearly to top_k at
    temperature 1 over dts_steps optimizer steps; a softmax at that temperature, top k of it, renormalised."""
    cfg = moe_cfg(router="dts", experts=8, top_k=2, dts_steps=6, dts_temperature=2.0)
    r = ROUTERS["dts"](cfg).train()
    r.step = step
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(8, DIM, generator=torch.Generator().manual_seed(6)))
    x = tokens(64)
    out = r(x)
    w64 = r.gate.weight.detach().double().requires_grad_(True)
    chosen, wt, probs, _ = ref_route("softmax", x, w64, k=k, temperature=temperature)
    assert out.experts.shape == (64, k)
    assert out.experts.tolist() == chosen
    torch.testing.assert_close(out.weights.double(), wt.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(out.probs.double(), probs.detach(), rtol=2e-6, atol=1e-7)
    coef = torch.randn(wt.shape, dtype=torch.float64)
    (g,) = torch.autograd.grad((out.weights.double() * coef).sum(), r.gate.weight)
    (g_ref,) = torch.autograd.grad((wt * coef).sum(), w64)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_sinkhorn_assignment_is_top_k_when_top_k_is_already_balanced():
    """Tokens whose top-k already load every expert evenly keep their top-k (the assignment only moves
    choices it must), and the weights are the renormalised softmax probabilities of what was assigned."""
    e, k, t = 8, 2, 64
    cfg = moe_cfg(router="sinkhorn", experts=e, top_k=k)
    r = ROUTERS["sinkhorn"](cfg).train()
    gate = torch.eye(e, DIM) * 4.0
    with torch.no_grad():
        r.gate.weight.copy_(gate)
    x = torch.zeros(t, DIM)
    for i in range(t):  # token i prefers expert i % e, then (i + 1) % e
        x[i, i % e], x[i, (i + 1) % e] = 1.0, 0.6
    out = r(x)
    assert out.experts.tolist() == [[i % e, (i + 1) % e] for i in range(t)]
    chosen, wt, _, _ = ref_route("softmax", x, r.gate.weight, k=k)
    torch.testing.assert_close(out.weights.double(), wt.detach(), rtol=2e-6, atol=1e-7)
    # skewed: every token prefers expert 0; the assignment still loads each expert T k / E times
    skew = r(x + torch.nn.functional.one_hot(torch.zeros(t, dtype=torch.long), DIM) * 3.0)
    assert torch.bincount(skew.experts.flatten(), minlength=e).tolist() == [t * k // e] * e
    assert all(len(set(row)) == k for row in skew.experts.tolist())


# ----------------------------------------------------------------------------------------------
# a cast of the model keeps the router fp32


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_a_cast_to_bf16_keeps_the_gate_and_the_selection_bias_fp32(router):
    """model.to(torch.bfloat16) (generation, an HF load in bf16) rounded the gate weights and the selection
    bias to 3 digits, so bf16 decoding routed otherwise than the run trained; transformers keeps DeepSeek-V3's
    in fp32 (_keep_in_fp32_modules_strict). A cast to float64 is not a narrowing: everything follows it."""
    cfg = load_config(overrides={"model": {"preset": "debug-moe", "moe.router": router}}).model
    model = build_model(cfg, seed=0)
    routers = [layer.router for layer in moe_layers(model)]
    with torch.no_grad():
        for r in routers:
            r.expert_bias.copy_(0.1234567 + 1e-3 * torch.randn(r.expert_bias.shape))
    gates = [r.gate.weight for r in routers]
    want = [(r.gate.weight.detach().clone(), r.expert_bias.clone()) for r in routers]
    tokens = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    x = torch.randn(24, cfg.dim, generator=torch.Generator().manual_seed(1))
    chosen = [r(x).experts for r in routers]
    model.to(torch.bfloat16)
    for r, g, (w, b), c in zip(routers, gates, want, chosen):
        assert r.gate.weight is g and r.gate.weight.dtype == r.expert_bias.dtype == torch.float32
        assert torch.equal(r.gate.weight, w) and torch.equal(r.expert_bias, b)
        assert torch.equal(r(x.bfloat16()).experts, r(x.bfloat16().float()).experts)
        assert torch.equal(r(x).experts, c)
    assert model.layers[0].attention.wq.weight.dtype == torch.bfloat16
    assert model(tokens).dtype == torch.bfloat16
    model.to(torch.float64)
    assert all(r.gate.weight.dtype == r.expert_bias.dtype == torch.float64 for r in routers)


def test_a_cast_keeps_the_gates_gradient_in_its_dtype():
    """The kept fp32 gate's gradient was cast to bf16 with the model: the next AdamW step mixed dtypes."""
    cfg = load_config(overrides={"model": {"preset": "debug-moe"}}).model
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, None, None, labels=tokens).backward()
    model.to(torch.bfloat16)
    gates = [layer.router.gate.weight for layer in moe_layers(model)]
    assert all(g.dtype == g.grad.dtype == torch.float32 for g in gates)
    torch.optim.AdamW(gates, lr=1e-3).step()
