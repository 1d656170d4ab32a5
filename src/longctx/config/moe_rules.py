"""[model.moe]'s rules (config/rules.py validate asks them with the model's other rules) and the notes a MoE
run prints for settings that are allowed but easy to get wrong."""

from __future__ import annotations

from .inert_options import dense_moe_notes
from .layer_lists import parse_layer_list
from .schema import MOE_FAMILIES


def moe_notes(m) -> list[str]:
    """What a run should hear about its [model.moe] settings that is allowed but easy to get wrong."""
    if not m.is_moe:
        return dense_moe_notes(m)  # (keys the dense model ignores)
    notes = []
    if m.moe_top_k == 1 and m.moe_norm_topk and m.moe_router != "switch":
        notes.append(f"model.moe.top_k 1 with norm_topk true: every routing weight is 1 (as transformers' top-1 "
                     f"Mixtral and Qwen-MoE compute it), so the {m.moe_router} router learns from the balancing "
                     f"losses alone, never from the model's loss; set --model.moe.norm_topk false (the weight is the "
                     f"expert's probability, as the Switch Transformer's) to let the loss reach it")
    return notes


def moe_rules(m, problems: list[str]) -> None:
    """[model.moe]: each impossible combination named with its fix."""
    if m.moe_experts < 0:
        problems.append(f"model.moe.experts must be >= 0 (0 = a dense model), got {m.moe_experts}.")
    if m.family in MOE_FAMILIES and not m.is_moe:
        problems.append(f"model.family = {m.family} is a Mixture-of-Experts family but model.moe.experts is 0; set "
                        f"model.moe.experts (or pick a dense family).")
    if not m.is_moe:
        return
    e, k = m.moe_experts, m.moe_top_k
    if not 1 <= k <= e:
        problems.append(f"model.moe.top_k ({k}) must be between 1 and model.moe.experts ({e}).")
    if m.moe_router == "switch" and k != 1:
        problems.append(f"model.moe.router = switch routes each token to one expert, but model.moe.top_k is {k}; "
                        f"set --model.moe.top_k 1 (or use router softmax for top-{k}).")
    for key in ("expert_dim", "shared_experts", "shared_dim", "dts_steps", "sinkhorn_iters", "capacity_factor",
                "aux_loss", "z_loss", "bias_update_rate"):
        if getattr(m, f"moe_{key}") < 0:
            problems.append(f"model.moe.{key} must be >= 0, got {getattr(m, f'moe_{key}')}.")
    if m.moe_route_scale <= 0:  # (0 silences the routed experts: the loss reaches neither them nor the router)
        problems.append(f"model.moe.route_scale must be positive (1 = unscaled weights), got {m.moe_route_scale}.")
    if m.moe_shared_gate and not m.resolved_shared_dim:
        problems.append("model.moe.shared_gate gates the shared experts, but there are none: set "
                        "model.moe.shared_experts or model.moe.shared_dim.")
    if m.moe_groups < 1 or e % m.moe_groups:
        problems.append(f"model.moe.groups ({m.moe_groups}) must divide model.moe.experts ({e}).")
    elif not 1 <= m.moe_topk_groups <= m.moe_groups:
        problems.append(f"model.moe.topk_groups ({m.moe_topk_groups}) must be between 1 and model.moe.groups "
                        f"({m.moe_groups}).")
    elif m.moe_groups > 1 and k > m.moe_topk_groups * (e // m.moe_groups):  # (groups 1: the top_k rule)
        problems.append(f"model.moe.top_k ({k}) is more than the experts in model.moe.topk_groups "
                        f"({m.moe_topk_groups}) groups of {e // m.moe_groups}.")
    if m.moe_groups > 1 and m.moe_router != "sigmoid":
        problems.append(f"model.moe.groups limits the sigmoid router's choice; router {m.moe_router} has no groups "
                        f"(set --model.moe.router sigmoid or groups 1).")
    if m.moe_capacity_factor > 0 and m.moe_router in ("sinkhorn", "dts"):
        why = ("balances its assignment itself" if m.moe_router == "sinkhorn"
               else "sends every token to every expert early on")
        problems.append(f"model.moe.capacity_factor drops tokens over an expert's capacity, but router "
                        f"{m.moe_router} {why}: use capacity_factor 0 (dropless) or router softmax/switch/sigmoid.")
    if m.moe_bias_update_rate > 0 and m.moe_router == "sinkhorn":
        problems.append("model.moe.bias_update_rate balances the load through a selection bias; router sinkhorn "
                        "balances its assignment itself: set one of them.")
    if m.moe_router == "dts" and (m.moe_dts_temperature <= 0):
        problems.append(f"model.moe.dts_temperature must be positive, got {m.moe_dts_temperature}.")
    try:
        dense = parse_layer_list(m.moe_dense_layers)
    except ValueError as err:
        problems.append(f"model.moe.dense_layers: {err}.")
    else:
        beyond = sorted(i for i in dense if i >= m.layers)
        if beyond:
            problems.append(f"model.moe.dense_layers names layers {beyond}, but the model has {m.layers} "
                            f"(0-{m.layers - 1}).")
        elif m.layers > 0 and len(dense) == m.layers:
            problems.append("model.moe.dense_layers makes every layer dense; set model.moe.experts 0 for a dense "
                            "model, or leave some layers to the experts.")
