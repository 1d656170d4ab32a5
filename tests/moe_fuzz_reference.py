"""A per-token float64 reference of one MoE layer (models/moe.py MoEFeedForward) and its balancing losses
(models/moe_stats.py router_terms), written from docs/moe.md and the papers, not from the layer's code, for
tests/unit/test_moe_fuzz116.py.

What it computes, for tokens x [T, dim] (padding: `real` [T] False) and float64 copies of the layer's weights:
- router logits l = W_gate x; per router (docs/moe.md's table, /work/shared/REFERENCES.md):
  softmax (GShard / Mixtral / Qwen): p = softmax(l), the k best of p + bias (the selection bias moves the
  choice, never the weight), weights p[chosen], divided by their sum with norm_topk (at k = 1: 1), x route_scale;
  switch (Switch Transformer): top-1, weight p[chosen] whatever norm_topk says, x route_scale;
  sigmoid (DeepSeek-V3): s = sigmoid(l), the balancing loss reads s / sum(s); a group scores the sum of its two
  best biased scores, a token picks among its topk_groups best groups; weights s[chosen] / (sum + 1e-20);
  dts (DTS-Gate, no Gumbel noise): at step t of n, done = min(1, t / n), temperature T0 + (1 - T0) done,
  floor(E + (k - E) done + 1/2) experts (at least k) of softmax(l / temperature), weighted as softmax's;
  sinkhorn (S-BASE): in evaluation softmax's top-k; in training the balanced assignment (given, its contract
  checked by the caller), weighted by the softmax probabilities as softmax's;
- capacity (GShard, capacity_factor > 0): each expert keeps ceil(cf x N x k / E) choices, slot 0's of every
  token first, then slot 1's, each slot in token order; N the real tokens; padding queues for nothing and is
  never kept. Without a capacity padding runs through its experts (only the statistics leave it out), except
  under the sinkhorn router in training, whose assignment leaves it out (not kept);
- output: sum over kept choices of weight x SwiGLU_e(x) (w2 (silu(w1 x) * w3 x)), plus the shared SwiGLU,
  times sigmoid(g x) with a shared gate;
- losses over the real tokens: aux = E sum_e f_e P_e (f_e the fraction of the choices before drops, P_e the
  mean probability; `pooled`: f_e = choices / N, which sums to k), z = mean of logsumexp(l)^2,
  loss = aux_w aux + z_w z.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F


def ranked(values: list[float], k: int) -> list[int]:
    """The indices of the k largest values, best first (a plain sort)."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


def margin(values: list[float], k: int) -> float:
    """How far the k-th best value is above the (k + 1)-th (inf when every value is chosen): near 0, a
    rounding difference between the layer (fp32) and this reference (fp64) may pick other experts."""
    s = sorted(values, reverse=True)
    return math.inf if k >= len(s) else s[k - 1] - s[k]


def dts_schedule(case: dict) -> tuple[float, int]:
    """DTS-Gate's (temperature, experts per token) at the case's step (in evaluation, moe.dts_eval schedule);
    a router without a step (a model no run set one on) trains from step 0 and evaluates as the schedule ends."""
    if case.get("no_step"):
        return dts_schedule({**case, "no_step": False, "step": 0}) if case["training"] else (1.0, case["top_k"])
    done = 1.0 if case["dts_steps"] == 0 else min(1.0, case["step"] / case["dts_steps"])
    temperature = case["dts_temperature"] + (1.0 - case["dts_temperature"]) * done
    # (rounded half up, exactly: docs/moe.md's floor(x + 1/2), not round()'s ties to even)
    exact = Fraction(1) if case["dts_steps"] == 0 else min(Fraction(1), Fraction(case["step"], case["dts_steps"]))
    return temperature, max(case["top_k"], math.floor(case["experts"] + (case["top_k"] - case["experts"]) * exact
                                                      + Fraction(1, 2)))


def _sigmoid_choice(scores: torch.Tensor, bias: list[float], case: dict) -> tuple[list[int], float]:
    e, groups, k = case["experts"], case["groups"], case["top_k"]
    biased = [float(v) + b for v, b in zip(scores.tolist(), bias)]
    size = e // groups
    group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:min(2, size)]) for g in range(groups)]
    best = ranked(group_score, case["topk_groups"])
    allowed = [biased[i] if i // size in best else -math.inf for i in range(e)]
    close = min(margin(group_score, case["topk_groups"]), margin(allowed, k))
    return ranked(allowed, k), close


def route_token(logits: torch.Tensor, case: dict, bias: list[float], assigned: list[int] | None):
    """One token's (chosen experts, weights [k] with gradient, probabilities [E] the balancing loss reads,
    the selection's margin)."""
    router, k = case["router"], case["top_k"]
    if router == "sigmoid":
        scores = torch.sigmoid(logits)
        chosen, close = _sigmoid_choice(scores.detach(), bias, case)
        w = scores[chosen]
        if case["norm_topk"]:
            w = w / (w.sum() + 1e-20)
        return chosen, w * case["route_scale"], scores / scores.sum(), close
    temperature = 1.0
    if router == "dts":
        temperature, k = dts_schedule(case) if case["training"] or case["dts_eval"] == "schedule" else (1.0, k)
    p = torch.softmax(logits / temperature, -1)
    select = [float(v) + b for v, b in zip(p.tolist(), bias)]
    chosen, close = (assigned, math.inf) if assigned is not None else (ranked(select, k), margin(select, k))
    w = p[chosen]
    if case["norm_topk"] and router != "switch":
        w = w / w.sum()
    return chosen, w * case["route_scale"], p, close


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2 (silu(w1 x) * w3 x), the weights stored as nn.Linear stores them ([out, in])."""
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def capacity_keeps(chosen: list[list[int]], real: list[bool], case: dict) -> list[list[bool]]:
    """Which choices a capacity keeps: slot 0's of every token first, then slot 1's, in token order."""
    e, k, cf = case["experts"], len(chosen[0]) if chosen else case["top_k"], case["capacity_factor"]
    if cf <= 0:
        dropless = case["router"] == "sinkhorn" and case["training"]  # (its assignment leaves padding out)
        return [[r or not dropless] * len(c) for c, r in zip(chosen, real)]
    capacity = math.ceil(cf * sum(real) * k / e)
    taken, kept = [0] * e, [[False] * k for _ in chosen]
    for j in range(k):
        for t, c in enumerate(chosen):
            if real[t]:
                kept[t][j] = taken[c[j]] < capacity
                taken[c[j]] += 1
    return kept


def reference_layer(x: torch.Tensor, params: dict, case: dict, real: list[bool], bias: list[float],
                    assigned: list[list[int]] | None = None) -> dict:
    """The layer's output [T, dim], its choices and kept flags, the balancing losses and the smallest
    selection margin, from float64 `params` (names as the layer's named_parameters) with gradient."""
    gate = params["router.gate.weight"]
    routed = [route_token(gate @ row, case, bias, None if assigned is None else assigned[t])
              for t, row in enumerate(x)]
    chosen = [r[0] for r in routed]
    kept = capacity_keeps(chosen, real, case)
    rows = []
    for t, row in enumerate(x):
        y = torch.zeros_like(row)
        for j, e in enumerate(chosen[t]):
            if kept[t][j]:
                f = swiglu(row, params["experts.w1"][e], params["experts.w3"][e], params["experts.w2"][e])
                y = y + routed[t][1][j] * f
        if "shared.w1.weight" in params:
            s = swiglu(row, params["shared.w1.weight"], params["shared.w3.weight"], params["shared.w2.weight"])
            if "shared_gate.weight" in params:
                s = torch.sigmoid(params["shared_gate.weight"][0] @ row) * s
            y = y + s
        rows.append(y)
    out = {"y": torch.stack(rows) if rows else x * 0, "chosen": chosen, "kept": kept,
           "margin": min([r[3] for r in routed], default=math.inf)}
    out.update(_losses(x, gate, routed, kept, real, case))
    return out


def _losses(x, gate, routed, kept, real, case) -> dict:
    e = case["experts"]
    n = max(1, sum(real))
    counts = [0.0] * e
    prob_sum = x.new_zeros(e)
    lse_sq = x.new_zeros(())
    dropped = 0
    for t, row in enumerate(x):
        if not real[t]:
            continue
        for c in routed[t][0]:
            counts[c] += 1
        prob_sum = prob_sum + routed[t][2]
        lse_sq = lse_sq + torch.logsumexp(gate @ row, -1) ** 2
        dropped += sum(not k for k in kept[t])
    choices = max(1.0, sum(counts))
    fraction = torch.tensor(counts, dtype=x.dtype) / choices
    aux = e * (fraction * prob_sum / n).sum()
    pooled = e * (torch.tensor(counts, dtype=x.dtype) / n * prob_sum / n).sum()
    z = lse_sq / n
    reported = pooled if case["aux_loss_scope"] == "pooled" else aux
    return {"aux": aux, "z": z, "loss": case["aux_loss"] * reported + case["z_loss"] * z,
            "drop_rate": dropped / choices, "counts": counts, "prob_sum": prob_sum, "n": n}


def combine_layers(refs: list[dict], case: dict) -> dict:
    """The balancing loss of L layers (docs/moe.md aux_loss_scope): per_layer_mean the mean of the layers' aux,
    per_layer_sum their sum, pooled (transformers' load_balancing_loss_func) E sum_e F_e Q_e over the L x N
    pooled choices and probabilities (F sums to k); z the mean over the layers either way."""
    n_layers, e, n = len(refs), case["experts"], refs[0]["n"]
    aux = torch.stack([r["aux"] for r in refs])
    z = torch.stack([r["z"] for r in refs]).mean()
    counts = torch.tensor([r["counts"] for r in refs], dtype=z.dtype).sum(0) / (n_layers * n)
    prob = torch.stack([r["prob_sum"] for r in refs]).sum(0) / (n_layers * n)
    scoped = {"per_layer_mean": aux.mean(), "per_layer_sum": aux.sum(), "pooled": e * (counts * prob).sum()}
    return {"aux": aux.mean(), "z": z, "loss": case["aux_loss"] * scoped[case["aux_loss_scope"]] + case["z_loss"] * z}
