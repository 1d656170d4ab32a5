"""The random MoE cases of tests/unit/test_moe_fuzz116.py: a seeded configuration the config rules accept
(`make_case`), its layer with random weights, selection bias and skew (`build`), its tokens and padding mask
(`tokens`), and a call run in a memory policy's pieces (`in_pieces`)."""

from __future__ import annotations

import random

import torch

from longctx.config import load_config
from longctx.models.moe import MoEFeedForward

ROUTERS = ("softmax", "switch", "sigmoid", "dts", "sinkhorn")


def _groups(rng: random.Random, e: int, k: int) -> tuple[int, int]:
    """(groups, topk_groups) the sigmoid router accepts: groups divides E, k fits in the allowed groups."""
    groups = rng.choice([g for g in range(1, e + 1) if e % g == 0 and e // g >= 1])
    fits = [m for m in range(1, groups + 1) if k <= m * (e // groups)]
    return groups, rng.choice(fits)


def make_case(seed: int) -> dict:
    """One random configuration the config rules accept (config/moe_rules.py), and its data's shape."""
    rng = random.Random(seed)
    router = ROUTERS[seed % len(ROUTERS)]
    e = rng.randint(2, 8)
    k = 1 if router == "switch" else rng.randint(1, min(4, e))
    groups, topk_groups = _groups(rng, e, k) if router == "sigmoid" else (1, 1)
    drops = router in ("softmax", "switch", "sigmoid")
    shared = rng.choice(["none", "plain", "gated"])
    dts_steps = rng.choice([0, 3, 4, 6, 10])
    return dict(
        seed=seed, router=router, experts=e, top_k=k, groups=groups, topk_groups=topk_groups,
        dim=rng.choice([16, 24, 32, 40, 48, 64]), hidden=rng.choice([6, 8, 12, 16]),
        capacity_factor=rng.choice([0.0, 0.5, 0.75, 1.0, 1.1, 1.25, 2.0, 4.0]) if drops else 0.0,
        expert_chunk=rng.choice([0, 0, 3, 7]),
        shared_dim=0 if shared == "none" else rng.choice([8, 12]), shared_gate=shared == "gated",
        norm_topk=rng.random() < 0.6, route_scale=rng.choice([1.0, 1.0, 2.5]),
        aux_loss=rng.choice([0.0, 0.01, 0.3]), z_loss=rng.choice([0.0, 1e-3, 0.1]),
        aux_loss_scope=rng.choice(["per_layer_mean", "per_layer_sum", "pooled"]),
        dts_steps=dts_steps, dts_temperature=rng.uniform(1.0, 3.0), step=rng.randint(0, dts_steps + 1),
        dts_eval=rng.choice(["schedule", "top_k"]),
        training=rng.random() < 0.6 if router in ("dts", "sinkhorn") else True,
        bias=rng.random() < 0.5 and router != "sinkhorn",
        rows=rng.randint(1, 3), seq=rng.randint(5, 16), padded=rng.random() < 0.4,
        skew=rng.choice([None, None, rng.randrange(e)]),
        dtype=rng.choice([torch.float32, torch.float32, torch.float64]),
        no_step=rng.random() < 0.2,  # (dts: a model no run set a step on: training from step 0, evaluation top-k)
        pieces=rng.choice([1, 1, 2, 3]),  # (a memory policy's pieces of the call: memory.block_chunk)
    )


def moe_config(case: dict):
    moe = {key: case[key] for key in ("experts", "top_k", "router", "groups", "topk_groups", "capacity_factor",
                                      "shared_dim", "shared_gate", "norm_topk", "route_scale", "aux_loss", "z_loss",
                                      "aux_loss_scope", "dts_steps", "dts_temperature", "dts_eval")}
    model = {"preset": "debug-moe", "dim": case["dim"], "heads": 2, "kv_heads": 2, "moe.expert_dim": case["hidden"],
             "moe.shared_experts": 0, **{f"moe.{k}": v for k, v in moe.items()}}
    return load_config(overrides={"model": model}).model


def build(case: dict) -> MoEFeedForward:
    """The case's layer with random weights, its selection bias and (skew) one expert's gate row pointed
    along the tokens' common direction (`direction`), so that most tokens pick that expert first."""
    layer = MoEFeedForward(moe_config(case))
    gen = torch.Generator().manual_seed(1000 + case["seed"])
    with torch.no_grad():
        for name, p in layer.named_parameters():  # (the gate's logits of a few units; the experts' fan-in scaled)
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if name.startswith("router") else p.shape[-1] ** -0.5))
        if case["bias"]:
            layer.router.expert_bias.copy_(torch.randn(case["experts"], generator=gen) * 0.05)
        if case["skew"] is not None:
            push = case.get("skew_strength", 4.0) * direction(case) / direction(case).square().sum()
            layer.router.gate.weight[case["skew"]] += push
    if case["router"] == "dts":
        layer.router.step = None if case["no_step"] else case["step"]
    layer.experts.chunk = case["expert_chunk"]  # (memory.expert_chunk: checkpointed pieces of rows)
    return layer.to(case["dtype"]).train(case["training"])


def direction(case: dict) -> torch.Tensor:
    return torch.randn(case["dim"], generator=torch.Generator().manual_seed(7 + case["seed"]))


def tokens(case: dict, attempt: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [rows, seq, dim] (with the common direction under skew) and the padding mask [rows x seq] (each row's
    last tokens padding, as data/loader.py pads a packed row; None without padding)."""
    gen = torch.Generator().manual_seed(100 * case["seed"] + attempt)
    x = torch.randn(case["rows"], case["seq"], case["dim"], generator=gen)
    if case["skew"] is not None:
        x = x + direction(case)
    if not case["padded"]:
        return x.to(case["dtype"]), None
    real = torch.ones(case["rows"], case["seq"], dtype=torch.bool)
    for r in range(case["rows"]):
        real[r, int(torch.randint(0 if r else 2, case["seq"] + 1, (1,), generator=gen)):] = False
    return x.to(case["dtype"]), real.flatten()


def in_pieces(layer: MoEFeedForward, flat: torch.Tensor, case: dict) -> torch.Tensor:
    """The call `flat` [T, dim] run in the case's pieces, as memory/apply_policy.py runs a block in chunks: a
    layer whose routing looks across tokens first hands over every piece's routing input and decides over the
    whole call (_PieceRouting), then each piece runs with its slice of the decisions and of the padding mask."""
    from longctx.memory.apply_policy import _PieceRouting

    t = flat.shape[0]
    inner = random.Random(case["seed"]).sample(range(1, t), case["pieces"] - 1) if t >= case["pieces"] else []
    cuts = [0, *sorted(inner), *[t] * (case["pieces"] - 1 - len(inner)), t]  # (too few tokens: empty pieces)
    pieces = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    routing = _PieceRouting(layer) if layer.across_tokens() else None
    if routing is not None:
        layer.pieces = routing
        for sl in pieces:
            layer.piece = sl
            layer(flat[sl])
        routing.decide()
    outs = []
    for sl in pieces:
        layer.piece = sl
        if routing is not None:
            routing.piece = sl
        outs.append(layer(flat[sl]))
    layer.pieces = layer.piece = None
    return torch.cat(outs)
