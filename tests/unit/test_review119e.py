"""Review of 20312a4e (helper review119e): models/moe_stats.py `_RouterSums`, the one autograd node the routing
weights pass through beside a record's sums, against the plain ops it replaced (written here: `_plain_record`,
the record before 20312a4e), over random calls: values and gradients bit for bit, with and without padding, a
z-loss gradient or not, every backward subset (the layer's output alone, the sums alone, both), fp32 / fp64 / bf16
inputs (gradients in the inputs' dtypes), and whole MoE layers of every router (softmax top-k, Switch top-1,
renormalised top-1, sigmoid, Sinkhorn, DTS) with and without a capacity (routing.kept)."""

import dataclasses

import pytest
import torch

from longctx.config import load_config
from longctx.models import moe_stats
from longctx.models.moe import MoEFeedForward
from longctx.models.moe_dispatch import Routing, expert_counts


def _plain_record(routing: Routing, tokens: int, num_experts: int, real=None, z_grad: bool = True):
    """The record of a call by the plain ops (moe_stats.record before 20312a4e), the routing left as it is."""
    logits = routing.logits if z_grad else routing.logits.detach()
    if real is None:
        counts = expert_counts(routing.experts.flatten(), num_experts).float()
        dropped = (torch.zeros(()) if routing.kept is None else (~routing.kept).sum().float())
        return moe_stats.RouterRecord(counts, routing.probs.sum(0), logits.logsumexp(-1).square().sum(), tokens,
                                      dropped, moe_stats._rows(routing, counts, num_experts)), routing
    choice = torch.where(real[:, None], routing.experts, num_experts).flatten()
    counts = expert_counts(choice, num_experts + 1)[:num_experts].float()
    dropped = torch.zeros(()) if routing.kept is None else (~routing.kept & real[:, None]).sum().float()
    weight = real.to(routing.probs.dtype)
    return moe_stats.RouterRecord(counts, (routing.probs * weight[:, None]).sum(0),
                                  (logits.logsumexp(-1).square() * weight).sum(), real.sum().float(), dropped,
                                  moe_stats._rows(routing, counts, num_experts)), routing


def _op_case(seed: int, dtype, recorder, use: str, pad: bool, z_grad: bool):
    """One random call through `recorder`: (record values, routed weights, gradients of the logits leaf)."""
    g = torch.Generator().manual_seed(seed)
    t, e = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
    k = int(torch.randint(1, e + 1, (1,), generator=g))
    logits = (torch.randn(t, e, generator=g) * 3).to(dtype).requires_grad_()
    probs = logits.softmax(-1)
    chosen = probs.detach().float().topk(k, -1).indices
    kept = torch.rand(t, k, generator=g) > 0.3 if seed % 2 else None
    routing = Routing(chosen, probs.gather(1, chosen), probs, logits, kept)
    real = torch.rand(t, generator=g) > 0.4 if pad else None
    rec, routed = recorder(routing, t, e, real, z_grad)
    loss = torch.zeros((), dtype=torch.float64)
    if use in ("weights", "both"):
        loss = loss + (routed.weights.double() * torch.randn(t, k, generator=g, dtype=torch.float64)).sum()
    if use in ("sums", "both"):
        loss = loss + (rec.prob_sum.double() * torch.randn(e, generator=g, dtype=torch.float64)).sum()
        if rec.lse_sq_sum.requires_grad:
            loss = loss + rec.lse_sq_sum.double() * 0.37
    loss.backward()
    values = [rec.counts, rec.prob_sum.detach(), rec.lse_sq_sum.detach(), torch.as_tensor(rec.tokens),
              rec.dropped, rec.rows, routed.weights.detach()]
    return values, logits.grad, rec.lse_sq_sum.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("use", ["weights", "sums", "both"])
def test_router_sums_match_the_plain_ops_bit_for_bit(dtype, use):
    for seed in range(24):
        pad, z_grad = bool(seed & 4), bool(seed & 8)
        new = _op_case(seed, dtype, moe_stats.record, use, pad, z_grad)
        ref = _op_case(seed, dtype, _plain_record, use, pad, z_grad)
        for a, b in zip(new[0], ref[0]):
            assert a.dtype == b.dtype and torch.equal(a, b), (seed, a, b)
        assert new[2] == ref[2]  # the z figure has a gradient exactly when z_grad
        assert (new[1] is None) == (ref[1] is None), seed
        if ref[1] is not None:  # the logits' gradient in their own dtype, the same bits
            assert new[1].dtype == dtype and torch.equal(new[1], ref[1]), (seed, (new[1] - ref[1]).abs().max())


def test_router_sums_under_autocast_and_inference_mode():
    """Autocast (bf16) around the record: the sums and gradients are the plain ops' (the router itself runs
    without autocast: fp32 logits); under inference_mode (evaluation, generation) the record still works."""
    grads = []
    for recorder in (moe_stats.record, _plain_record):
        logits = torch.randn(12, 6, generator=torch.Generator().manual_seed(5)).requires_grad_()
        real = torch.arange(12) % 3 > 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            probs = logits.softmax(-1)
            chosen = probs.detach().topk(2, -1).indices
            rec, routed = recorder(Routing(chosen, probs.gather(1, chosen), probs, logits), 12, 6, real, True)
            loss = routed.weights.sum() * 0.3 + rec.prob_sum[0] + rec.lse_sq_sum
        loss.backward()  # (outside the autocast, as the training step's: step_run.py forward_backward)
        assert logits.grad.dtype == rec.prob_sum.dtype == rec.lse_sq_sum.dtype == torch.float32
        grads.append((logits.grad, rec.prob_sum.detach(), rec.lse_sq_sum.detach()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.inference_mode():
        logits = torch.randn(5, 4)
        probs = logits.softmax(-1)
        chosen = probs.topk(1, -1).indices
        rec, routed = moe_stats.record(Routing(chosen, probs.gather(1, chosen), probs, logits), 5, 4)
        assert torch.equal(rec.prob_sum, probs.sum(0)) and torch.equal(routed.weights, probs.gather(1, chosen))


LAYERS = {"softmax-k2": {"top_k": 2}, "softmax-k2-capacity": {"top_k": 2, "capacity_factor": 1.0},
          "switch-capacity": {"router": "switch", "top_k": 1, "capacity_factor": 1.25},
          "top1": {"top_k": 1, "norm_topk": "false"}, "sigmoid": {"router": "sigmoid"},
          "sigmoid-capacity": {"router": "sigmoid", "capacity_factor": 1.25}, "sinkhorn": {"router": "sinkhorn"},
          "dts": {"router": "dts"}}


def _layer_run(moe: dict, z_loss: float, pad: bool, use: str, recorder, monkeypatch):
    """A MoE layer's training call (record kept) and the gradients of its input and parameters."""
    monkeypatch.setattr(moe_stats, "record", recorder)
    over = [f"--model.moe.{k}={v}" for k, v in moe.items()]
    cfg = load_config(overrides=["--model.preset=debug-moe", f"--model.moe.z_loss={z_loss}", *over])
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg.model).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 96, cfg.model.dim, generator=g).requires_grad_()
    layer.recording, layer.real = True, (torch.rand(96, generator=g) > 0.3 if pad else None)
    out = layer(x)
    rec = layer.records[-1]
    loss = (out * torch.randn(out.shape, generator=g)).sum() if use != "sums" else torch.zeros(())
    if use != "weights":
        loss = loss + (rec.prob_sum * torch.randn(rec.prob_sum.shape, generator=g)).sum()
        loss = loss + (rec.lse_sq_sum * 0.01 if rec.lse_sq_sum.requires_grad else 0.0)
    loss.backward()
    grads = [x.grad, *(p.grad for p in layer.parameters())]
    return [out.detach(), rec.prob_sum.detach(), rec.lse_sq_sum.detach(), rec.counts, rec.rows], grads


@pytest.mark.parametrize("name", list(LAYERS))
def test_moe_layers_train_as_with_the_plain_ops(name, monkeypatch):
    for z_loss, pad, use in [(0.001, False, "both"), (0.0, True, "both"), (0.001, True, "weights"),
                             (0.001, False, "sums"), (0.0, False, "weights")]:
        new = _layer_run(LAYERS[name], z_loss, pad, use, moe_stats.record, monkeypatch)
        ref = _layer_run(LAYERS[name], z_loss, pad, use, _plain_record, monkeypatch)
        for a, b in zip(new[0], ref[0]):
            assert torch.equal(a, b), (z_loss, pad, use)
        for a, b in zip(new[1], ref[1]):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (z_loss, pad, use)


def test_routed_weights_are_the_routers_values():
    """The weights the dispatch reads are the router's (a view through the node), not a copy or a detached one."""
    logits = torch.randn(4, 3).requires_grad_()
    probs = logits.softmax(-1)
    chosen = probs.detach().topk(2, -1).indices
    routing = Routing(chosen, probs.gather(1, chosen), probs, logits)
    _, routed = moe_stats.record(routing, 4, 3, None, False)
    assert routed.weights.requires_grad and torch.equal(routed.weights, routing.weights)
    assert all(getattr(routed, f.name) is getattr(routing, f.name) for f in dataclasses.fields(Routing)
               if f.name != "weights")
