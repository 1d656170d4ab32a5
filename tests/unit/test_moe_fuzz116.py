"""Randomized audit of the MoE layer (models/moe.py MoEFeedForward, its capacity, dispatch, statistics and
balancing losses) against an independent per-token float64 reference (tests/moe_fuzz_reference.py, written
from docs/moe.md and the papers: its docstring says which formula each router follows).

40 seeded configurations (`make_case`): hidden 16-64, 2-8 experts, top-k 1..min(4, E), every router
(softmax, switch, sigmoid with groups, DTS-Gate at a random step in training and evaluation, sinkhorn in
training and evaluation), capacity none / small (drops) / large, shared experts with and without their
gate, norm_topk and route_scale, a selection bias, aux and z weights under each aux scope, padded rows
(the layer's `real` mask), skewed routing (one expert's gate row biased toward the tokens' common
direction), the layer in fp32 or fp64 (its router selects in fp32 either way). Each compares the choices
and kept flags exactly, and the output, the balancing loss, its unweighted figures and the drop rate, and
the gradients of the input and every parameter of (y * r).sum() + loss, to fp32 rounding; some run the call
in a memory policy's pieces (memory/apply_policy.py _PieceRouting), and each also runs a call of no token.
Two layers in a row check how router_terms combines layers under each aux scope. The cases themselves are
tests/moe_fuzz_cases.py's.

Expert parallelism (parallel/expert/install.py; 6-17 s, one spawned job): a few random configurations on 2 gloo ranks
(flat exchange, FSMoE chunks, hierarchical, FlexMoE copy slots), each rank's call against the one-process
layer on the same tokens (some with a rank of no token): outputs, losses summed over the ranks, every
gradient; and the two ranks' tokens as one micro-batch (a `call_tokens` over them, as one share or two), a
capacity's drops and the Sinkhorn assignment decided over both, against one call of all of them.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from longctx.models.moe import MoEFeedForward
from longctx.models.moe_stats import router_terms
from moe_fuzz_cases import ROUTERS, build, in_pieces, make_case, tokens
from moe_fuzz_reference import combine_layers, dts_schedule, reference_layer

CASES = 40


def run_layer(layer: MoEFeedForward, case: dict, x: torch.Tensor, real, probe: torch.Tensor) -> dict:
    """One training forward of the layer (recording, as the model runs it), its router_terms, and the
    gradients of (y * probe).sum() + loss for the input and every parameter."""
    layer.real, layer.recording, layer.records = real, True, []
    xi = x.detach().clone().requires_grad_(True)
    y = layer(xi) if case["pieces"] == 1 else in_pieces(layer, xi.reshape(-1, x.shape[-1]), case).view(x.shape)
    terms = router_terms([layer], case["aux_loss"], case["z_loss"])
    names = [n for n, p in layer.named_parameters()]
    grads = torch.autograd.grad((y * probe).sum() + terms.loss, [xi, *layer.parameters()], allow_unused=True)
    with torch.no_grad():
        routing = layer.route(x.reshape(-1, x.shape[-1]))
    return {"y": y.detach(), "loss": terms.loss.detach(), "stats": terms.stats, "counts": terms.counts[0],
            "grads": dict(zip(["x", *names], grads)), "routing": routing}


def reference(layer: MoEFeedForward, case: dict, x: torch.Tensor, real, probe, assigned=None) -> dict:
    params = {n: p.detach().double().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    xr = x.detach().reshape(-1, x.shape[-1]).double().requires_grad_(True)
    mask = [True] * xr.shape[0] if real is None else real.tolist()
    bias = layer.router.expert_bias.double().tolist()
    ref = reference_layer(xr, params, case, mask, bias, assigned)
    total = (ref["y"] * probe.double().reshape(ref["y"].shape)).sum() + ref["loss"]
    grads = torch.autograd.grad(total, [xr, *params.values()], allow_unused=True)
    ref["grads"] = dict(zip(["x", *params], grads))
    return ref


def close(got: torch.Tensor, want: torch.Tensor, what: str, case: dict) -> None:
    """fp32 rounding: the router selects and weighs in fp32 whatever the layer's dtype."""
    want = torch.zeros(got.shape, dtype=torch.float64) if want is None else want.reshape(got.shape)
    got = torch.zeros_like(want) if got is None else got.double()
    scale = 1.0 + want.abs().max().item() if want.numel() else 1.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= 1e-5 * scale, f"{what}: max |layer - reference| {err:.3e} (scale {scale:.3g}) in case {case}"


def check_sinkhorn_assignment(chosen: torch.Tensor, real, case: dict) -> None:
    """S-BASE's contract on the real tokens: k distinct experts each, every expert floor or ceil of N k / E."""
    rows = chosen if real is None else chosen[real]
    e, k = case["experts"], case["top_k"]
    assert all(len(set(r)) == k for r in rows.tolist())
    loads = torch.bincount(rows.flatten(), minlength=e)
    even = rows.shape[0] * k / e
    assert loads.min() >= math.floor(even) and loads.max() <= math.ceil(even), (loads, case)


def fuzz_case(seed: int) -> dict:
    """Run case `seed` against the reference (a fresh draw of the tokens while the reference's selection
    is within 1e-4 of a tie, where fp32 and fp64 may rightly choose differently). Returns what it covered."""
    case = make_case(seed)
    layer = build(case)
    for attempt in range(8):
        x, real = tokens(case, attempt)
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)
        got = run_layer(layer, case, x, real, probe)
        assigned = None
        if case["router"] == "sinkhorn" and case["training"]:
            check_sinkhorn_assignment(got["routing"].experts, real, case)
            assigned = got["routing"].experts.tolist()
        want = reference(layer, case, x, real, probe, assigned)
        if want["margin"] > 1e-4:
            break
    else:
        pytest.fail(f"no draw of tokens without a near-tie in case {case}")
    compare(got, want, real, case)
    check_empty_call(layer, case)
    return {**case, "dropped": want["drop_rate"], "tokens": x.shape[0] * x.shape[1]}


def check_empty_call(layer: MoEFeedForward, case: dict) -> None:
    """A call of no token (a rank whose share of a batch holds none, tests/unit/test_moe_empty_calls_audit.py):
    an empty output, zero balancing terms and zero gradients, for every router and option."""
    x = torch.zeros(1, 0, case["dim"], dtype=case["dtype"])
    got = run_layer(layer, {**case, "pieces": 1}, x, None if not case["padded"] else torch.zeros(0, dtype=torch.bool),
                    torch.zeros_like(x))
    assert got["y"].shape == x.shape and got["loss"].item() == 0 and not got["stats"].any(), (got, case)
    assert all(g is None or not g.any() for g in got["grads"].values()), case


def compare(got: dict, want: dict, real, case: dict) -> None:
    routing = got["routing"]
    mask = [True] * len(want["chosen"]) if real is None else real.tolist()
    chosen = routing.experts.tolist()
    for t, m in enumerate(mask):
        if m:  # (padding's choices are no part of the contract, only that a capacity keeps none)
            assert chosen[t] == want["chosen"][t], (t, chosen[t], want["chosen"][t], case)
    kept = [[True] * len(c) for c in chosen] if routing.kept is None else routing.kept.tolist()
    assert kept == want["kept"], (kept, want["kept"], case)
    close(got["y"], want["y"], "output", case)
    close(got["loss"], want["loss"], "balancing loss", case)
    close(got["stats"][0], want["aux"], "aux figure", case)
    close(got["stats"][1], want["z"], "z figure", case)
    close(got["stats"][4], torch.tensor(want["drop_rate"], dtype=torch.float64), "drop rate", case)
    assert got["counts"].tolist() == want["counts"], (got["counts"], want["counts"], case)
    for name, g in got["grads"].items():
        close(g, want["grads"][name], f"gradient of {name}", case)


def test_fuzz_cases_cover_every_router_and_option():
    """The draw itself: every router, drops, padding, skew, shared experts and fp64 appear."""
    cases = [make_case(s) for s in range(CASES)]
    assert {c["router"] for c in cases} == set(ROUTERS)
    assert any(c["capacity_factor"] and c["capacity_factor"] < 1 for c in cases)
    assert any(c["capacity_factor"] >= 2 for c in cases)
    assert any(c["padded"] and c["capacity_factor"] for c in cases)
    assert any(c["skew"] is not None and c["capacity_factor"] for c in cases)
    assert {c["top_k"] for c in cases} >= {1, 2, 3, 4}
    assert any(c["shared_gate"] for c in cases) and any(c["dtype"] == torch.float64 for c in cases)
    assert any(c["router"] == "dts" and 0 < c["step"] < c["dts_steps"] for c in cases)
    assert any(c["router"] == "sigmoid" and c["groups"] > 1 for c in cases)
    assert any(c["router"] == "dts" and c["no_step"] for c in cases) and any(c["expert_chunk"] for c in cases)
    assert any(c["pieces"] > 1 and c["capacity_factor"] and c["padded"] for c in cases)
    assert any(c["pieces"] > 1 and c["router"] == "sinkhorn" and c["training"] for c in cases)


@pytest.mark.parametrize("seed", range(CASES))
def test_moe_layer_matches_per_token_reference(seed):
    fuzz_case(seed)


@pytest.mark.parametrize("seed", range(200, 209))
def test_two_layers_combine_their_losses_as_the_scope_says(seed):
    """Two layers in a row (x + first(x) into the second, as blocks chain them; the same E), router_terms over
    both against combine_layers, under each aux_loss_scope: the loss, its figures and every gradient."""
    case = {**make_case(seed), "aux_loss_scope": ("per_layer_mean", "per_layer_sum", "pooled")[seed % 3],
            "aux_loss": 0.3, "padded": False}
    first, second = build(case), build({**case, "seed": case["seed"] + 5000})
    for attempt in range(8):
        x, _ = tokens(case, attempt)
        x = x.reshape(-1, case["dim"])
        params = {f"{i}.{n}": p for i, layer in enumerate((first, second)) for n, p in layer.named_parameters()}
        xi = x.clone().requires_grad_(True)
        for layer in (first, second):
            layer.real, layer.recording, layer.records = None, True, []
        h = xi + first(xi)
        y = second(h)
        terms = router_terms([first, second], case["aux_loss"], case["z_loss"])
        got = torch.autograd.grad(y.sum() + terms.loss, [xi, *params.values()])
        ref_params = {n: p.detach().double().clone().requires_grad_(True) for n, p in params.items()}
        xr = x.double().requires_grad_(True)
        refs, inner = [], xr
        for i, layer in enumerate((first, second)):
            mine = {n[2:]: p for n, p in ref_params.items() if n.startswith(f"{i}.")}
            assigned = layer.route(inner.float().to(x.dtype)).experts.tolist() if case["router"] == "sinkhorn" \
                and case["training"] else None
            refs.append(reference_layer(inner, mine, case, [True] * x.shape[0],
                                        layer.router.expert_bias.double().tolist(), assigned))
            inner = inner + refs[-1]["y"] if i == 0 else refs[-1]["y"]
        if min(r["margin"] for r in refs) > 1e-4:
            break
    else:
        pytest.fail(f"no draw of tokens without a near-tie in case {case}")
    want = combine_layers(refs, case)
    want_grads = torch.autograd.grad(inner.sum() + want["loss"], [xr, *ref_params.values()])
    close(y.detach(), inner.detach(), "output", case)
    close(terms.loss.detach(), want["loss"], "loss", case)
    close(terms.stats[0], want["aux"], "aux figure", case)
    close(terms.stats[1], want["z"], "z figure", case)
    for name, g, w in zip(["x", *params], got, want_grads):
        close(g, w, f"gradient of {name}", case)


def test_grouped_sigmoid_router_routes_a_call_of_no_token():
    """Regression (found by this fuzz under expert parallelism, a rank holding no token): the sigmoid router
    with moe.groups > 1 viewed its scores as [T, groups, -1], which a call of T = 0 cannot infer, and raised."""
    case = {**make_case(17), "router": "sigmoid", "experts": 6, "top_k": 2, "groups": 3, "topk_groups": 2,
            "capacity_factor": 0.0, "padded": False}
    layer = build(case)
    check_empty_call(layer, case)
    assert layer.router(torch.zeros(0, case["dim"], dtype=case["dtype"])).experts.shape == (0, 2)


def test_dts_schedule_reference_is_the_documented_one():
    """The reference's DTS schedule: every expert at T0 at step 0, top-k at temperature 1 from dts_steps on."""
    case = dict(experts=8, top_k=2, dts_steps=4, dts_temperature=2.0, step=0)
    assert dts_schedule(case) == (2.0, 8)
    assert dts_schedule({**case, "step": 4}) == (1.0, 2) == dts_schedule({**case, "step": 9})
    assert dts_schedule({**case, "step": 2}) == (1.5, 5)


# ----------------------------------------------------------------------------------------------
# expert parallelism on 2 gloo ranks against one process

EP_OPTIONS = ({}, {"pipeline_chunks": 2}, {"ranks_per_node": 1}, {"replicas": 1, "placement_window": 2})


def ep_case(seed: int) -> dict:
    """A random case with an even expert count (2 ranks split them), fp32, skewed on odd seeds."""
    while make_case(seed)["experts"] % 2:
        seed += 1000
    case = {**make_case(seed), "dtype": torch.float32}
    if seed % 2:
        case["skew"] = seed % case["experts"]
    return case


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over 1 + max |want| (fp32 rounding of sums of a few terms: ~1e-7)."""
    return ((got - want).abs().max() / (1 + want.abs().max())).item() if want.numel() else 0.0


def _sum_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    torch.distributed.all_reduce(t)
    return t


class _RankTokens:
    """A CallTokens (models/moe_capacity.py) over the 2 ranks, each holding `t` tokens of one micro-batch (rank
    0's first): `shares` True, each rank a data-parallel share of its own (its capacity queue places from
    the shares' counts); False, both ranks one share (the choices gathered)."""

    def __init__(self, t: int, shares: bool):
        self.t, self.shares, self.rank = t, shares, torch.distributed.get_rank()

    def gather(self, local):
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    def mine(self, full):
        return full[self.rank * self.t:(self.rank + 1) * self.t]

    def gather_share(self, local):
        return local if self.shares else self.gather(local)

    def mine_share(self, share):
        return share if self.shares else self.mine(share)

    def share_counts(self, counts):
        return (self.gather(counts[None]), self.rank) if self.shares else (counts[None], 0)

    def routes_alone(self):
        return False


def _one_process(base, case: dict, calls, probes, across: bool):
    """The one-process layer on both ranks' calls: as two calls, or (`across`: the ranks hold one micro-batch,
    decided across) as one call of all their tokens. (layer, [output per call], [input leaf per call], terms)."""
    one = copy.deepcopy(base)
    xs = [x.clone().requires_grad_(True) for x, _ in calls]
    reals = [real for _, real in calls]
    if across:
        one.real, one.recording = None if reals[0] is None else torch.cat(reals), True
        ys = one(torch.cat(xs)).split([x.shape[0] for x in xs])
    else:
        ys = []
        for x, real in zip(xs, reals):
            one.real, one.recording = real, True
            ys.append(one(x))
    terms = router_terms([one], case["aux_loss"], case["z_loss"])
    (sum((y * p).sum() for y, p in zip(ys, probes)) + terms.loss).backward()
    return one, ys, xs, terms


def _ep_rank(seeds: list[int], across: bool) -> dict:
    """On each of 2 ranks: each case's layer under expert parallelism (the case's dispatcher option) on
    this rank's tokens, against one process running both ranks' calls: the worst difference of the
    outputs, the losses and every gradient (non-expert ones summed over the ranks, expert ones the owner's).
    `across`: the two ranks' tokens are one micro-batch (call_tokens, _RankTokens): a capacity and the
    Sinkhorn assignment decided over both, as one call of all of them decides."""
    from torch.distributed.device_mesh import init_device_mesh

    from longctx.parallel.expert.install import use_expert_parallel
    from longctx.parallel.expert.placement import plan_placement

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("expert_data", "expert"))
    rank, out = torch.distributed.get_rank(), {}
    for i, seed in enumerate(seeds):
        case, options = ep_case(seed), EP_OPTIONS[i % len(EP_OPTIONS)]
        base = build(case)
        calls = [tokens({**case, "seq": case["seq"] + (0 if across else 3 * r)}, 50 + r) for r in range(2)]
        calls = [(x.reshape(-1, case["dim"]), real) for x, real in calls]
        if not across and i % 3 == 0:  # rank 0 holds no token (its share of the batch is empty)
            calls[0] = (calls[0][0][:0], None if calls[0][1] is None else calls[0][1][:0])
        probes = [torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r, (x, _) in enumerate(calls)]
        one, ys, xs, terms = _one_process(base, case, calls, probes, across)
        ep = copy.deepcopy(base)
        use_expert_parallel(ep, mesh, **options)
        if across:
            ep.call_tokens = _RankTokens(calls[0][0].shape[0], shares=bool(i % 2))
        if options.get("replicas"):  # FlexMoE: a copy of the hottest expert on the other rank
            load = [1.0] * case["experts"]
            load[case["skew"] or 0] = 10.0
            ep.experts.placement = plan_placement(load, 2, 1)
            assert ep.experts.placement.copies, ep.experts.placement
        (x, real), probe = calls[rank], probes[rank]
        ep.real, ep.recording = real, True
        xi = x.clone().requires_grad_(True)
        y = ep(xi) if case["pieces"] == 1 else in_pieces(ep, xi, case)  # (as many pieces on each rank)
        ep_terms = router_terms([ep], case["aux_loss"], case["z_loss"], sum_over_ranks=_sum_ranks)
        ((y * probe).sum() + ep_terms.loss).backward()
        worst = {"output": _rel(y, ys[rank]), "x grad": _rel(xi.grad, xs[rank].grad),
                 "loss": _rel(_sum_ranks(ep_terms.loss), terms.loss), "stats": _rel(ep_terms.stats, terms.stats)}
        for (name, p), q in zip(ep.named_parameters(), one.parameters()):
            if name.startswith("experts."):  # (scaled by 1 / group: the loop's world-size loss scale undoes it)
                got, want = p.grad.to_local() * 2, q.grad.chunk(2)[rank]
            else:
                got, want = _sum_ranks(p.grad), q.grad
            worst[f"{name} grad"] = _rel(got, want)
        worst["dropped"] = float(terms.stats[4])
        out[seed] = (options, worst)
    return out


def test_expert_parallel_matches_one_process_on_random_cases():
    from longctx.job.spawn import run_spawned_many

    # (dispatch options in EP_OPTIONS' order, twice: capacities with drops under each, padding, skew, every router)
    seeds = [3001, 3045, 3021, 3050, 3003, 3029, 3057, 3051, 3059]
    results = run_spawned_many(2, [("apart", _ep_rank, (seeds, False)), ("across", _ep_rank, (seeds, True))])
    for per_rank in [*results["apart"], *results["across"]]:
        for seed, (options, worst) in per_rank.items():
            case = ep_case(seed)
            print(seed, options, {k: case[k] for k in ("router", "experts", "top_k", "capacity_factor", "skew")},
                  f"dropped {worst.pop('dropped'):.2f}, worst relative difference {max(worst.values()):.2e}")
            bad = {k: v for k, v in worst.items() if v > 1e-5}
            assert not bad, (seed, options, ep_case(seed), bad)
