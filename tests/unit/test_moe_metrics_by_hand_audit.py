"""The MoE figures of a metrics line (docs/moe.md, Metrics) computed by hand from a skewed debug-moe layer's own
router choices under a capacity that drops most of the hot experts' choices, against what the step hook logs.

`expert_rank_load` is the busiest expert rank's load: the rows it RUNS (the doc: what the copies take off the hot
rank, as the placement policy reads them; a dropped choice never reaches a rank). It was computed from the
router's choices before the drops: for this call it logged 1.53 where the ranks ran 1.25 (expert 0 capped at its
capacity), a straggler that does not exist."""

import math
from types import SimpleNamespace as NS

import pytest
import torch

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers, router_terms
from longctx.train.moe_hooks import moe_step_hooks

E, K, EP, T = 8, 2, 2, 96


def _skewed_step(capacity: float, expert: int = EP, router: str = "softmax"):
    """One training step's router figures of a debug-moe layer (top 2 of 8) whose router sends a choice of
    every token to expert 0: (the line's record, the layer's routing of the step's tokens)."""
    cfg = load_config("configs/debug.toml", ["--train.steps=10", "--model.preset=debug-moe", "--model.layers=2",
                                             f"--model.moe.top_k={K}", f"--model.moe.capacity_factor={capacity}",
                                             f"--model.moe.router={router}", "--model.moe.dts_steps=4",
                                             f"--model.moe.bias_update_rate={0.01 if router == 'softmax' else 0}"])
    model = build_model(cfg.model)
    (layer,) = moe_layers(model)
    torch.nn.init.normal_(layer.router.gate.weight, std=0.2, generator=torch.Generator().manual_seed(0))
    if router == "softmax":  # (the others balance themselves: their choices are their own)
        layer.router.expert_bias[0] = 5.0  # (every token among expert 0's, on rank 0)
    model.set_router_step(1)  # (the dts router: its schedule at step 1 of 4, between all experts and top-k)
    (hook,) = moe_step_hooks(cfg, model, NS(dims=NS(expert=expert)))
    hook.model = NS(router_terms=lambda: router_terms([layer], 0.0, 0.0), update_expert_bias=lambda c: None)
    x = torch.randn(T, layer.router.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        routing = layer.route(x)
        layer.recording = True
        layer(x)
    hook.after_forward(1, 1.0)
    hook.after_optimizer(1, torch.tensor(True))
    return hook.log_fields(1, last=True), routing, layer


def _by_hand(routing, capacity: float) -> dict:
    """Every figure from the router's choices, probabilities and logits alone."""
    k = routing.experts.shape[1]  # (dts: more than top_k while its schedule anneals)
    choices = [0] * E
    for e in routing.experts.flatten().tolist():
        choices[e] += 1
    cap = math.ceil(capacity * T * K / E) if capacity else T * E  # (dropless: no expert is capped)
    ran = [min(c, cap) for c in choices]  # an expert keeps at most its capacity of its choices
    per_rank = [sum(ran[q * E // EP:(q + 1) * E // EP]) for q in range(EP)]
    probs = routing.probs.double().mean(0).tolist()
    return {"moe_load_mean": max(choices) * E / sum(choices), "k": k,
            "moe_drop_rate": (sum(choices) - sum(ran)) / sum(choices),
            "expert_rank_load": max(per_rank) / (sum(per_rank) / EP),
            "moe_aux_loss": E * sum(c / sum(choices) * p for c, p in zip(choices, probs)),
            "moe_z_loss": routing.logits.double().logsumexp(-1).square().mean().item(),
            "moe_expert_load": [round(100 * E * c / sum(choices)) for c in choices]}


@pytest.mark.parametrize("capacity,router", [(0.0, "softmax"), (1.0, "softmax"), (0.0, "dts"), (0.0, "sinkhorn")])
def test_each_logged_figure_is_what_its_doc_says(capacity, router):
    record, routing, layer = _skewed_step(capacity, router=router)
    hand = _by_hand(routing, capacity)
    if capacity:
        assert hand["moe_drop_rate"] > 0.3  # the capacity binds hard on the hot experts
    for field in ("moe_load_mean", "moe_drop_rate", "moe_aux_loss", "moe_z_loss", "expert_rank_load"):
        assert record[field] == pytest.approx(hand[field], rel=1e-5, abs=1e-6), field
    assert record["moe_load_worst"] == pytest.approx(hand["moe_load_mean"], rel=1e-6)  # one MoE layer
    assert record["moe_layer_load"] == [round(hand["moe_load_mean"], 3)]
    assert record["moe_expert_load"] == [hand["moe_expert_load"]]
    if router == "softmax":
        assert record["moe_bias_norm"] == [pytest.approx(5.0, rel=1e-3)]
    if router == "dts":
        assert K < hand["k"] < E  # (its load figures count each of a token's choices at the step's k)
    if capacity:
        assert record["moe_layer_drop"] == [round(hand["moe_drop_rate"], 4)]
    else:
        assert "moe_layer_drop" not in record


def test_rank_load_is_what_the_ranks_run_not_what_the_router_chose():
    record, routing, _ = _skewed_step(1.0)
    chosen = torch.bincount(routing.experts.flatten(), minlength=E).tolist()
    per_rank_chosen = [sum(chosen[:E // EP]), sum(chosen[E // EP:])]
    before_drops = max(per_rank_chosen) / (sum(per_rank_chosen) / EP)
    assert before_drops > 1.3  # the router's choices alone would show a straggler ...
    assert record["expert_rank_load"] == pytest.approx(_by_hand(routing, 1.0)["expert_rank_load"])
    assert record["expert_rank_load"] < before_drops - 0.2  # ... the capacity took off the hot rank
