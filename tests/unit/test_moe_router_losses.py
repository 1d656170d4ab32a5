"""Mixture of Experts' balancing against hand-written references on small cases (models/moe.py): the
aux and z losses against their formulas (each moe.aux_loss_scope, and summed over simulated ranks),
the capacity's drops counted, and the aux-loss-free bias once per optimizer step. The routers are in
test_moe_routers.py (whose helpers this imports), the layer and grouped_mm in test_moe_grouped_mm.py."""

import math

import pytest
import torch
from test_moe_routers import DIM, T, grads, leaf, make_layer

from longctx.config import load_config
from longctx.models.moe import router_terms, update_expert_bias

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
# the aux-loss-free bias, once per optimizer step


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
