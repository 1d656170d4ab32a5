"""Memory policies on a MoE model with capacity drops, GQA and packed documents, over 5 optimizer steps:
recomputation must route the same tokens and drop the same ones, and offload must restore what it saved,
so every step's loss and the final weights equal the plain run's. Tolerance: fp32 on CPU, where a restored
or chunked tensor may sit at another alignment or be summed in another order (about 1 ulp, 2e-8 in a gradient);
SGD rather than Adam, whose g / sqrt(v) blows such noise up on near-zero gradients (3e-5 in the loss by step 5).
A flipped routing or capacity drop moves the loss by far more than the tolerance."""

import copy

import pytest
import torch

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model
from probes import packed_batch

POLICIES = [("full", 0.0, 0), ("selective", 0.0, 0), ("selective", 0.5, 0), ("selective", 1.0, 16),
            ("full", 0.3, 24)]


def _train(model, batch, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*batch[:3], labels=batch[3])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def moe_reference():
    # capacity 1.0 over 2 x 64 tokens and 8 experts, top-2: some experts overflow, so drops happen
    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.layers=3",
                                 "--model.moe.capacity_factor=1.0"]).model
    base = build_model(cfg, seed=3)
    batch = packed_batch(cfg)
    return base, batch, _train(copy.deepcopy(base), batch)


@pytest.mark.parametrize("policy,fraction,chunk", POLICIES)
def test_moe_policy_five_steps_match_plain(moe_reference, policy, fraction, chunk):
    base, batch, (ref_losses, ref_weights) = moe_reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    losses, weights = _train(model, batch)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=1e-5, msg=name)
