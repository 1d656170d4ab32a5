"""FlexMoE's placer (parallel/expert/placement.py) cuts the rows each expert RUNS over its holders, so it must plan
from them: with a capacity (moe.capacity_factor) under skewed routing the hot experts' dropped choices never travel.
The step hook handed it the router's choices (before the drops): for a skewed top-3 call at capacity 0.5 the plan
predicted a max/mean rank load of 1.00 while the rows it placed gave 1.22, worse than no copies at all (1.19)."""

from types import SimpleNamespace as NS

import torch

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import MoEFeedForward, moe_layers, router_terms
from longctx.parallel.expert.placement import Placement, plan_placement
from longctx.train.moe_hooks import moe_step_hooks

EP = 4


def _skewed(capacity: float):
    """A debug-moe model of one MoE layer (top 3 of 8) whose router sends most first choices to experts 0 and 5,
    its step hook reading that layer's records."""
    cfg = load_config("configs/debug.toml", ["--train.steps=10", "--model.preset=debug-moe", "--model.layers=2",
                                             "--model.moe.top_k=3", f"--model.moe.capacity_factor={capacity}"])
    model = build_model(cfg.model)
    (layer,) = moe_layers(model)
    torch.nn.init.normal_(layer.router.gate.weight, std=0.2)
    layer.router.expert_bias[0], layer.router.expert_bias[5] = 5.0, 2.5
    (hook,) = moe_step_hooks(cfg, model, NS(dims=NS(expert=1)))
    hook.model = NS(router_terms=lambda: router_terms([layer], 0.0, 0.0), update_expert_bias=lambda c: None)
    return layer, hook


def _step(layer: MoEFeedForward, hook, x) -> list[int]:
    """One step of one micro-batch through the hook; returns the rows each expert ran (the dispatcher's counts)."""
    ran = []
    dispatch = layer.dispatcher.dispatch

    def counted(flat, routing):
        rows, counts, state = dispatch(flat, routing)
        ran.append(counts)
        return rows, counts, state
    layer.dispatcher = NS(dispatch=counted, run_experts=layer.dispatcher.run_experts, combine=layer.dispatcher.combine)
    layer.recording = True
    layer(x)
    hook.after_forward(1, 1.0)
    hook.after_optimizer(1, torch.tensor(True))
    return ran[0].tolist()


def _rank_rows(placement: Placement, rows: list[int]) -> list[int]:
    per_slot = placement.slot_counts(rows)
    return [sum(per_slot[q * placement.slots:(q + 1) * placement.slots]) for q in range(EP)]


def test_the_placer_reads_the_rows_the_experts_ran():
    layer, hook = _skewed(0.5)
    x = torch.randn(254, layer.router.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    choices = torch.bincount(layer.route(x).experts.flatten(), minlength=8).tolist()
    ran = _step(layer, hook, x)
    assert max(choices) > 2 * max(ran)  # the capacity binds hard on the hot experts
    assert hook.router_counts.tolist() == [[float(r) for r in ran]]
    # planned from what it reads, the placement's prediction is what its rows give
    placement = plan_placement(hook.router_counts[0].tolist(), EP, 2)
    got = _rank_rows(placement, ran)
    assert max(got) / (sum(got) / EP) <= placement.predicted["max_over_mean_after"] + 0.05, got


def test_without_a_capacity_the_placer_reads_the_choices():
    layer, hook = _skewed(0.0)
    x = torch.randn(100, layer.router.gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    choices = torch.bincount(layer.route(x).experts.flatten(), minlength=8).float()
    _step(layer, hook, x)
    assert torch.equal(hook.router_counts, choices[None])
