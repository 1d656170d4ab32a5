"""MoE under skewed routing (audit): FlexMoE's placer restored from a checkpoint saved before a re-placement
drops the placements made since (a rollback restores it), and a step's moe_drop_rate is its choices dropped
over its choices when its micro-batches hold different numbers of real tokens (padding)."""

from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.models.moe import MoEFeedForward, router_terms
from longctx.parallel.expert.placement import ExpertPlacer
from longctx.train.moe_hooks import _StepSums
from longctx.train.router_metrics import RouterInterval


def _layers():
    return [NS(experts=NS(w1=torch.zeros(4, 8, 8), placement=None)) for _ in range(2)]


def test_a_restored_placer_drops_the_placements_made_after_its_state():
    placer = ExpertPlacer(_layers(), ep=2, replicas=1, window=3)
    skew = torch.tensor([[100.0, 1, 1, 1], [100.0, 1, 1, 1]])
    placer.observe(skew)
    saved = placer.state_dict()  # mid-window, nothing placed yet
    placer.observe(skew)
    placer.observe(skew)
    assert all(layer.experts.placement.copies for layer in placer.layers)
    placer.load_state_dict(saved)
    fresh = ExpertPlacer(_layers(), ep=2, replicas=1, window=3)
    fresh.load_state_dict(saved)
    assert [layer.experts.placement for layer in placer.layers] == [None, None]
    assert placer.state_dict() == fresh.state_dict() == saved
    placer.load_state_dict(None)  # (a checkpoint without placer state: the static start)
    assert placer.steps == 0 and placer.seen is None and placer.load is None


def test_the_drop_rate_is_the_steps_dropped_choices_over_its_choices():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, ffn_dim=32, moe_experts=8, moe_top_k=2, moe_expert_dim=24, moe_capacity_factor=1.0)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    layer.recording = True
    step, dropped, choices = _StepSums(), 0, 0
    for real, skew in ((8, 5.0), (200, 0.0)):  # a mostly padded, skewed micro-batch, then a full one
        layer.router.expert_bias.copy_(torch.tensor([skew, skew] + [0.0] * 6))
        layer.real = torch.arange(200) < real
        layer(torch.randn(200, 16))
        terms = router_terms([layer], 0.01, 0.0)
        step.add(terms)
        dropped, choices = dropped + int(terms.dropped.sum()), choices + int(terms.counts.sum())
    interval = RouterInterval([0], 1, 1)
    interval.add(1, step.stats, step.layer_load, step.counts, torch.tensor(True), step.dropped)
    record = interval.record(1)
    assert record["moe_drop_rate"] == pytest.approx(dropped / choices)
    assert record["moe_layer_drop"][0] == pytest.approx(dropped / choices, abs=1e-4)
