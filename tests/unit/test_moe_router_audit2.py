"""An audit of the MoE balancing against float64 references written here from the papers and transformers
(models/moe.py, moe_capacity.py, moe_dispatch.py, moe_stats.py, train/moe_hooks.py,
train/router_metrics.py): the balancing losses (each scope, padding, several calls) and the z-loss; the
capacity's drops by priority with padding out of the queues, and the layer's output and gradients through
them; the aux-loss-free bias update from a whole step's choices; the metrics' loads and drop rates over the
real tokens only. The routers' half, and the reference router used here (ref_route), are in
test_moe_router_audit.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_moe_router_audit import DIM, make_layer, ref_route, tokens

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers
from longctx.train.moe_hooks import MoEStepHook

# ----------------------------------------------------------------------------------------------
# the model's balancing losses, capacity and statistics, from each MoE layer's input


def ref_capacity(chosen, real, factor, e):
    """[T][k] kept flags: each expert keeps ceil(factor x N x k / E) choices, N the real tokens, slot 0's
    first, then in token order; padding queues nowhere and is never kept."""
    k = len(chosen[0])
    cap = math.ceil(factor * sum(real) * k / e)
    load, kept = [0] * e, [[False] * k for _ in chosen]
    for j in range(k):
        for t, c in enumerate(chosen):
            if real[t]:
                kept[t][j] = load[c[j]] < cap
                load[c[j]] += 1
    return kept


def ref_terms(inputs, gates, real, *, k, aux_w, z_w, scope, factor=0.0):
    """The balancing loss (weighted), stats [5], counts [L, E] and drops [L] of one micro-batch from each
    layer's input, float64 (differentiable through the inputs and the gates)."""
    aux, z, counts, drops, probs_sum, n = [], [], [], [], [], sum(real)
    m = torch.tensor(real, dtype=torch.float64)
    for h, w in zip(inputs, gates):
        chosen, _, probs, logits = ref_route("softmax", h, w, k=k)
        e = w.shape[0]
        c = torch.zeros(e, dtype=torch.float64)
        for t, row in enumerate(chosen):
            for ex in row:
                c[ex] += real[t]
        kept = ref_capacity(chosen, real, factor, e) if factor else None
        drops.append(sum(real[t] and not kk for t, row in enumerate(kept) for kk in row) if kept else 0)
        p_sum = (probs * m[:, None]).sum(0)
        aux.append(e * ((c / c.sum()) * (p_sum / n)).sum())
        z.append((torch.logsumexp(logits, -1) ** 2 * m).sum() / n)
        counts.append(c)
        probs_sum.append(p_sum)
    aux, z, counts = torch.stack(aux), torch.stack(z), torch.stack(counts)
    if scope == "pooled":  # transformers: each of the k choices counted, layers pooled
        tokens_l = n * len(inputs)
        aux_loss = e * (counts.sum(0) / tokens_l * torch.stack(probs_sum).sum(0) / tokens_l).sum()
    else:
        aux_loss = aux.sum() if scope == "per_layer_sum" else aux.mean()
    load = counts.max(1).values / counts.mean(1)
    stats = torch.stack([aux.mean(), z.mean(), load.mean(), load.max(),
                         torch.tensor(float(sum(drops))) / counts.sum()])
    return aux_w * aux_loss + z_w * z.mean(), stats, counts, torch.tensor(drops, dtype=torch.float64)


def model_config(**moe):
    model = {"preset": "debug-moe", "dim": 32, "heads": 2, "kv_heads": 2, "layers": 3, "vocab_size": 64,
             "moe.expert_dim": 16, "moe.dense_layers": "", **{f"moe.{k}": v for k, v in moe.items()}}
    return load_config(overrides={"model": model, "train": {"steps": 4, "seq_len": 64, "global_batch": 2},
                                  "metrics": {"log_interval": 2}})


def batch(seed, pad=(40, 64)):
    """[2, 64] tokens and labels; row 0 real up to pad[0], row 1 up to pad[1] (padding: one token, no label)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 63, (2, 64), generator=g)
    real = torch.arange(64)[None] < torch.tensor(pad)[:, None]
    ids = torch.where(real, ids, 63)
    labels = torch.where(real, ids.roll(-1, 1), -100)
    return ids, labels, real


def capture_inputs(model):
    inputs, handles = [], []
    for layer in moe_layers(model):
        handles.append(layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].flatten(0, 1))))
    return inputs, handles


@pytest.mark.parametrize("scope,factor,skew", [("per_layer_mean", 0.0, False), ("per_layer_sum", 1.0, True),
                                               ("pooled", 1.25, True), ("pooled", 0.0, False)])
def test_model_router_terms_match_the_reference(scope, factor, skew):
    """A 3-layer MoE model's router terms after a padded training forward: loss, stats, counts and drops
    against each layer's float64 reference over the real tokens, and the loss's gradient (gates and
    every earlier weight through the layers' inputs) against autograd through that reference."""
    cfg = model_config(aux_loss=0.3, z_loss=0.01, aux_loss_scope=scope, capacity_factor=factor)
    model = build_model(cfg.model, seed=0).train()
    if skew:  # most first choices go to expert 0
        for layer in moe_layers(model):
            with torch.no_grad():
                layer.router.gate.weight[0] += 0.5 * layer.router.gate.weight.norm(dim=0)
    ids, labels, real = batch(0)
    inputs, handles = capture_inputs(model)
    model(ids, labels=labels, real=real)
    for h in handles:
        h.remove()
    terms = model.router_terms()
    gates = [layer.router.gate.weight for layer in moe_layers(model)]
    ref_loss, stats, counts, drops = ref_terms([h.double() for h in inputs], [g.double() for g in gates],
                                               real.flatten().tolist(), k=2, aux_w=0.3, z_w=0.01, scope=scope,
                                               factor=factor)
    print(f"\n{scope} cf {factor}: loss {terms.loss.item():.8f} ref {ref_loss.item():.8f}; stats "
          f"{terms.stats.tolist()} ref {stats.tolist()}")
    torch.testing.assert_close(terms.counts.double(), counts)
    torch.testing.assert_close(terms.dropped.double(), drops)
    if factor and skew:
        assert drops.sum() > 0
    torch.testing.assert_close(terms.stats.double(), stats.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-7)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(terms.loss, params, allow_unused=True, retain_graph=True)
    want = torch.autograd.grad(ref_loss, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-7, msg=name)


def test_pooled_loss_with_padding_is_transformers_masked_loss():
    """The pooled scope with padding against transformers' load_balancing_loss_func given the attention mask."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = model_config(aux_loss=1.0, z_loss=0.0, aux_loss_scope="pooled")
    model = build_model(cfg.model, seed=1).train()
    ids, labels, real = batch(1, pad=(23, 50))
    inputs, handles = capture_inputs(model)
    model(ids, labels=labels, real=real)
    for h in handles:
        h.remove()
    terms = model.router_terms()
    logits = tuple(h @ layer.router.gate.weight.t() for h, layer in zip(inputs, moe_layers(model)))
    ref = load_balancing_loss_func(logits, 8, 2, attention_mask=real.long())
    torch.testing.assert_close(terms.loss, ref)


def swiglu64(x, w1, w3, w2):
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


@pytest.mark.parametrize("router,factor,norm", [("softmax", 1.0, True), ("softmax", 0.5, False),
                                                ("switch", 1.25, True), ("sigmoid", 1.0, True)])
def test_capacity_drops_by_priority_and_dropped_choices_add_nothing(router, factor, norm):
    """A skewed router (most first choices on expert 0) with a capacity and padding: the kept flags (slot 0
    first, then token order, real tokens only, N = real tokens), the layer's output (each kept choice's
    weight x its expert; a token with every choice dropped gives exactly 0: the residual alone) and its
    gradients against float64 autograd, and the recorded drops and counts."""
    k = 1 if router == "switch" else 2
    layer = make_layer(router=router, experts=8, top_k=k, capacity_factor=factor, norm_topk=norm).train()
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.4, 0.1, 0, 0, 0, 0, 0, 0]))
    t = 160
    x = tokens(t, seed=9)
    real = torch.ones(t, dtype=torch.bool)
    real[:20] = False  # padding first: it would take the queue's head if it counted
    real[100:130] = False
    x[~real] = x[0].clone()
    layer.real, layer.recording = real, True
    layer.records.clear()
    xa = x.clone().requires_grad_(True)
    y = layer(xa)
    layer.recording = False
    params = dict(layer.named_parameters())
    p64 = {n: p.detach().double().requires_grad_(True) for n, p in params.items()}
    x64 = x.double().requires_grad_(True)
    chosen, wt, _, _ = ref_route(router, x64, p64["router.gate.weight"], k=k, bias=layer.router.expert_bias,
                                 norm=norm)
    kept = ref_capacity(chosen, real.tolist(), factor, 8)
    rows = []
    for i in range(t):
        acc = torch.zeros(DIM, dtype=torch.float64)
        for j, ex in enumerate(chosen[i]):
            if kept[i][j]:
                acc = acc + wt[i, j] * swiglu64(x64[i], p64["experts.w1"][ex], p64["experts.w3"][ex],
                                               p64["experts.w2"][ex])
        rows.append(acc)
    ref = torch.stack(rows)
    rec = layer.records[0]
    n_dropped = sum(real[i].item() and not kk for i, row in enumerate(kept) for kk in row)
    assert n_dropped > 0 and rec.dropped.item() == n_dropped
    assert rec.tokens.item() == real.sum().item()
    counts = torch.zeros(8)
    for i, row in enumerate(chosen):
        for ex in row:
            counts[ex] += float(real[i])
    assert torch.equal(rec.counts, counts)
    all_dropped = [i for i in range(t) if not any(kept[i])]
    assert all_dropped and (y[all_dropped] == 0).all()  # padding and fully dropped tokens: exactly the residual
    torch.testing.assert_close(y.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    coef = torch.randn(t, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names = list(params)
    got = torch.autograd.grad((y.double() * coef).sum(), [xa, *params.values()], allow_unused=True)
    want = torch.autograd.grad((ref * coef).sum(), [x64, *p64.values()], allow_unused=True)
    for name, a, b in zip(["x", *names], got, want):
        if b is None:
            continue
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6, msg=name)
    assert got[names.index("router.gate.weight") + 1].abs().max() > 0


def step_of(model, hook, micro, applied=True):
    """One optimizer step's router side (moe_hooks.py) over micro-batches `micro` (no optimizer: weights fixed);
    returns each micro-batch's MoE inputs."""
    hook.step_start(1)
    seen = []
    for ids, labels, real in micro:
        inputs, handles = capture_inputs(model)
        loss = model(ids, labels=labels, real=real)
        for h in handles:
            h.remove()
        seen.append((inputs, real.flatten().tolist()))
        term = hook.after_forward(len(micro), 1.0)
        (loss + term).backward()
    hook.after_optimizer(1, torch.tensor(applied))
    return seen


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_bias_update_uses_the_whole_steps_real_choices(router):
    """Aux-loss-free balancing: after a step of 3 padded micro-batches the bias moves by rate x sign(mean - c)
    with c every micro-batch's choices of real tokens (not per micro-batch, not counting padding); an
    overloaded expert goes down. A step not applied moves nothing."""
    rate = 0.01
    cfg = model_config(router=router, aux_loss=0.0, z_loss=0.0, bias_update_rate=rate, capacity_factor=1.0)
    model = build_model(cfg.model, seed=2).train()
    for layer in moe_layers(model):  # skew: expert 3 overloaded
        with torch.no_grad():
            layer.router.expert_bias[3] = 0.3
    start = [layer.router.expert_bias.clone() for layer in moe_layers(model)]
    hook = MoEStepHook(cfg, model, 1, log=lambda *a: None)
    micro = [batch(10, pad=(64, 20)), batch(11, pad=(5, 64)), batch(12, pad=(33, 47))]
    seen = step_of(model, hook, micro)
    totals = torch.zeros(3, 8, dtype=torch.float64)
    per_micro_sign = torch.zeros(3, 8, dtype=torch.float64)
    loads, drops, chosen_all = [], torch.zeros(3), torch.zeros(3)
    for inputs, real in seen:
        mb = torch.zeros(3, 8, dtype=torch.float64)
        for li, (h, layer) in enumerate(zip(inputs, moe_layers(model))):
            chosen, _, _, _ = ref_route(router, h.detach(), layer.router.gate.weight.detach(), k=2, bias=start[li])
            for t, row in enumerate(chosen):
                for ex in row:
                    mb[li, ex] += real[t]
            kept = ref_capacity(chosen, real, 1.0, 8)
            drops[li] += sum(real[t] and not kk for t, row in enumerate(kept) for kk in row)
            chosen_all[li] += 2 * sum(real)
        totals += mb
        per_micro_sign += torch.sign(mb.mean(1, keepdim=True) - mb)
        loads.append(mb.max(1).values / mb.mean(1))
    want = torch.sign(totals.mean(1, keepdim=True) - totals) * rate
    assert want[:, 3].eq(-rate).all()  # the overloaded expert goes down
    assert not torch.equal(want, per_micro_sign * rate)  # (the case tells the two apart)
    for layer, b0, d in zip(moe_layers(model), start, want):
        torch.testing.assert_close((layer.router.expert_bias - b0).double(), d, rtol=0, atol=1e-7)
    # the metrics line: the step's per-layer load (mean over its micro-batches) and drop rate, real tokens only
    record = hook.log_fields(2, last=False)
    layer_load = torch.stack(loads).mean(0)
    assert record["moe_layer_load"] == [round(v, 3) for v in layer_load.tolist()]
    assert record["moe_load_mean"] == pytest.approx(layer_load.mean().item(), rel=1e-5)
    assert record["moe_layer_drop"] == [round(d / c, 4) for d, c in zip(drops.tolist(), chosen_all.tolist())]
    assert sum(record["moe_layer_drop"]) > 0
    # a step not applied: no move
    before = [layer.router.expert_bias.clone() for layer in moe_layers(model)]
    step_of(model, hook, micro[:1], applied=False)
    for layer, b in zip(moe_layers(model), before):
        assert torch.equal(layer.router.expert_bias, b)


@pytest.mark.parametrize("scope", ["per_layer_mean", "pooled"])
def test_a_micro_batch_entirely_of_padding_adds_no_nan(scope):
    """A micro-batch with no real token has no choice and no token: its balancing and z terms are 0 (they were
    0/0 = NaN, so the non-finite guard skipped the whole step), its gradient 0, and the step's load figures are
    the means over the micro-batches that route tokens: those of the same step without it."""
    cfg = model_config(aux_loss=0.01, z_loss=0.001, aux_loss_scope=scope, capacity_factor=1.0)
    model = build_model(cfg.model, seed=3).train()
    ids, labels, real = batch(20, pad=(0, 0))
    model(ids, labels=labels, real=real)
    terms = model.router_terms()
    assert terms.loss.item() == 0 and torch.isfinite(terms.stats).all() and terms.counts.sum() == 0
    full, empty = [batch(21, pad=(64, 20)), batch(22, pad=(5, 64))], batch(23, pad=(0, 0))
    lines = []
    for micro in (full, [full[0], empty, full[1]]):
        hook = MoEStepHook(cfg, model, 1, log=lambda *a: None)
        model.zero_grad()
        step_of(model, hook, micro)
        gate = moe_layers(model)[0].router.gate.weight.grad
        assert gate is not None and torch.isfinite(gate).all()
        lines.append(hook.log_fields(2, last=False))
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate"):
        assert lines[1][key] == pytest.approx(lines[0][key], rel=1e-6), key
    assert lines[1]["moe_layer_load"] == lines[0]["moe_layer_load"] and lines[0]["moe_aux_loss"] > 0
