"""A MoE layer's training forward keeps the router logits [T, E] (fp32) for backward only when the z-loss has a
weight (moe.z_loss > 0): the log-sum-exp it records otherwise feeds a term weighted 0 (the default, and every
transformers import), whose graph kept a [tokens, experts] fp32 tensor per MoE layer until backward. The figure is
still recorded (moe_z_loss), its value the same; the weighted z-loss keeps its gradient."""

import pytest
import torch

from longctx.config import ModelConfig
from longctx.memory.moe_counts import moe_ffn_bytes
from longctx.models.moe import MoEFeedForward, router_terms

T, E, DIM = 512, 32, 16


def _saved_bytes(layer, x) -> int:
    """Bytes of the distinct storages a forward of `layer` saves for backward."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def _layer(z_loss: float, router: str = "softmax") -> MoEFeedForward:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=DIM, ffn_dim=32, moe_experts=E, moe_top_k=2, moe_expert_dim=8, moe_router=router,
                      moe_z_loss=z_loss)
    return MoEFeedForward(cfg)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_recording_keeps_no_router_logits_without_a_z_loss(router):
    x = torch.randn(T, DIM, requires_grad=True)
    layer = _layer(0.0, router)
    plain = _saved_bytes(layer, x)
    layer.recording = True
    recorded = _saved_bytes(layer, x)
    # the records' own tensors are [E] sums and scalars; a [T, E] fp32 tensor is T * E * 4 = 64 KiB here
    assert recorded - plain < T * 4, (plain, recorded, T * E * 4)
    weighted = _layer(1e-3, router)
    weighted.recording = True
    assert _saved_bytes(weighted, x) - plain >= T * E * 4  # (the weighted z-loss needs them: as before)


def test_the_z_figure_is_the_same_and_the_weighted_z_loss_keeps_its_gradient():
    x = torch.randn(T, DIM)
    zero, weighted = _layer(0.0), _layer(0.5)
    weighted.load_state_dict(zero.state_dict())
    for layer in (zero, weighted):
        layer.recording = True
        layer(x)
    plain, with_z = router_terms([zero], 0.01, 0.0), router_terms([weighted], 0.01, 0.5)
    assert torch.equal(plain.stats, with_z.stats)  # the recorded z figure (stats[1]) does not depend on its weight
    gate = weighted.router.gate.weight
    g_with, = torch.autograd.grad(with_z.loss, gate)
    g_plain, = torch.autograd.grad(plain.loss, zero.router.gate.weight)
    assert (g_with - g_plain).abs().max() > 0  # the z-loss's own gradient reaches the gate


def test_a_z_weight_over_records_kept_without_its_gradient_is_refused():
    layer = _layer(0.0)
    layer.recording = True
    layer(torch.randn(T, DIM))
    with pytest.raises(ValueError, match="moe.z_loss"):
        router_terms([layer], 0.01, 0.3)


def test_the_memory_count_drops_the_logits_without_a_z_loss():
    m0 = ModelConfig(dim=DIM, ffn_dim=32, moe_experts=E, moe_top_k=2, moe_expert_dim=8)
    m1 = ModelConfig(dim=DIM, ffn_dim=32, moe_experts=E, moe_top_k=2, moe_expert_dim=8, moe_z_loss=1e-3)
    assert moe_ffn_bytes(m1, 4) - moe_ffn_bytes(m0, 4) == 4 * E + 4  # the logits and the log-sum-exp, per token
