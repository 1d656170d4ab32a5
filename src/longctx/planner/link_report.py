"""Why the plan does what it does over slow links: the link levels, the mode it picked (plain FSDP,
ZeRO++, hpZ on a node's group, co2) against the best plan without it, the chosen plan's bytes per link
level (planner/slow_links.py link_level_bytes), and co2 beside the plan when it was not allowed.

Every figure is the planner's own estimate (planner/cost.py); the text names the plan each is
compared with, so a reader can find both rows in the table or the JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..costs.shape import MeshShape
from .cost import Estimate
from .expert_levels import expert_sent_per_micro_batch, why_not_described
from .ranking import first
from .search import PlanResult, Request
from .slow_links import CO2_CAVEAT, co2_outer_bytes, co2_outer_seconds, link_level_bytes, three_level

SCOPE = ("FSDP / HSDP / ZeRO++ / CO2 bytes and, under expert parallelism, the expert all-to-alls (uniform "
         "routing) of one micro-batch step, job total")
LEVELS = {"inter_node_bytes": "inter-node", "intra_node_bytes": "intra-node", "intra_group_bytes": "intra-group"}


def links_text(req: Request) -> str:
    """The link levels the plan was made for, as ratios of the fastest."""
    hw, node = req.hardware, req.gpus_per_node
    if req.gpus <= node:
        return f"all {req.gpus} GPUs in one node: no inter-node link"
    text = (f"inter-node link {hw.inter_gbps:g} GB/s per GPU, 1/{hw.intra_gbps / hw.inter_gbps:.3g} of intra-node "
            f"{hw.intra_gbps:g}")
    group = three_level(hw, node)
    if group:
        text += (f"; three levels: groups of {group} ranks at {hw.intra_gbps:g} GB/s, a node's groups linked at "
                 f"{hw.middle_gbps:g} (1/{hw.intra_gbps / hw.middle_gbps:.3g})")
    return text


def levels_of(e: Estimate, req: Request) -> dict[str, int] | None:
    """slow_links.link_level_bytes of an estimate's layout, its expert all-to-alls from its own comm_bytes."""
    sent = expert_sent_per_micro_batch(e.comm_bytes, e.grad_accum)
    return link_level_bytes(req.model, e.mesh_shape, req.hardware, req.gpus_per_node, sent)


def _first(rows: Sequence[Estimate], keep: Callable[[MeshShape], bool]) -> Estimate | None:
    return first(rows, lambda x: keep(x.mesh_shape))


def _co2_why(best: Estimate, sync: Estimate | None, req: Request) -> str:
    s = best.mesh_shape
    allreduce = co2_outer_seconds(req.model, s, req.hardware, req.gpus_per_node)
    text = (f"co2 hides the replica all-reduce ({co2_outer_bytes(req.model, s) / 1e9:.3g} GB per rank, "
            f"{allreduce:.3g} s per round across nodes) under H={s.local_steps} steps of "
            f"{best.times['compute']:.3g} s compute ({best.times.get('exposed_co2_outer', 0.0):.3g} s exposed per "
            f"step); no gradient crosses nodes per step")
    if sync is not None:
        text += (f"; the best sync plan ({sync.mesh_shape.describe()}) takes {sync.step_s:.4g} s per step, co2 "
                 f"{best.step_s:.4g} s ({best.step_s / sync.step_s:.2f}x)")
        ours, theirs = (levels_of(e, req) for e in (best, sync))
        if ours and theirs:
            text += (f", {ours['inter_node_bytes'] / 1e9:.4g} GB across nodes per step against "
                     f"{theirs['inter_node_bytes'] / 1e9:.4g}")
    return f"{text}. Allowed by --allow co2, but {CO2_CAVEAT}"


def _fewer_local_steps(best: Estimate, rows: list[Estimate]) -> list[str]:
    """The fastest co2 plan with fewer local steps than the chosen one, if any: closer to sync's loss."""
    fewer = _first(rows, lambda x: x.data_parallel == "co2" and x.local_steps < best.mesh_shape.local_steps)
    if fewer is None:
        return []
    return [f"fewer local steps: {fewer.mesh_shape.describe()} ({fewer.policy.describe()}) takes {fewer.step_s:.4g} s "
            f"({fewer.step_s / best.step_s - 1:+.1%}); fewer local steps per round ended closer to sync's loss "
            f"(docs/benchmarks.md), worth the time where the loss matters more"]


def _same_plan(rows: Sequence[Estimate], e: Estimate, shape: MeshShape) -> Estimate | None:
    """The estimate of `e`'s policy and micro-batch under `shape`, if the search kept one."""
    return first(rows, lambda x: x.mesh_shape == shape and x.policy == e.policy and x.micro_batch == e.micro_batch)


def _hpz_level_why(best: Estimate, res: PlanResult) -> str:
    """hpZ's level: on a node's group (hpz_ranks) or on the node, against the other on the same plan."""
    req, s, hw = res.request, best.mesh_shape, res.request.hardware
    group = three_level(hw, req.gpus_per_node)
    other = _same_plan(res.feasible, best, dataclasses.replace(s, hpz_ranks=0 if s.hpz_ranks else group))
    if s.hpz_ranks:
        text = (f"hpZ's secondary partition on groups of {s.hpz_ranks} ranks (parallel.hpz_ranks = {s.hpz_ranks}): "
                f"backward's gathers stay inside a group at {hw.intra_gbps:g} GB/s instead of crossing the node's "
                f"groups at {hw.middle_gbps:g} GB/s, holding 1/{s.hpz_ranks} of the blocks instead of 1/{s.node}")
        if other is not None:
            text += (f": step {best.step_s:.4g} s against {other.step_s:.4g} s with hpZ on the node, "
                     f"{(best.memory['total'] - other.memory['total']) / 2**30:+.1f} GiB per GPU")
        return text
    if other is None:
        return f"hpZ on the node, not on groups of {group} ranks: that plan does not fit or was not kept"
    return (f"hpZ on the node, not on groups of {group} ranks: the groups' plan takes {other.step_s:.4g} s against "
            f"{best.step_s:.4g} s, holding {(other.memory['total'] - best.memory['total']) / 2**30:+.1f} GiB more "
            f"per GPU (1/{group} of the blocks instead of 1/{s.node})")


def _zero_pp_why(best: Estimate, res: PlanResult) -> str:
    req = res.request
    plain = _first(res.feasible, lambda x: not x.zero_pp and x.data_parallel == "sync")
    text = ("ZeRO++ (hpz+qwz+qgz): int8 weight gathers and gradient reduce-scatters across nodes, backward's "
            "gathers inside the node")
    if plain is not None:
        text += (f"; the best plain plan ({plain.mesh_shape.describe()}) takes {plain.step_s:.4g} s, ZeRO++ "
                 f"{best.step_s:.4g} s")
        ours, theirs = levels_of(best, req), levels_of(plain, req)
        if ours and theirs and theirs["inter_node_bytes"]:
            text += f", {ours['inter_node_bytes'] / theirs['inter_node_bytes']:.2f}x its inter-node bytes"
    if three_level(req.hardware, req.gpus_per_node):
        text += "; " + _hpz_level_why(best, res)
    return text


def co2_lines(res: PlanResult) -> list[str]:
    """co2 beside the plan: held out (not allowed), allowed but slower, or allowed and inapplicable."""
    req, best = res.request, res.best
    if res.co2_plans and best is not None:
        c = res.co2_plans[0]
        return [f"not chosen: co2 ({c.mesh_shape.describe()}, {c.policy.describe()}) would take {c.step_s:.4g} s per "
                f"step against {best.step_s:.4g} s ({c.step_s / best.step_s:.2f}x); --allow co2 lets the plan use it, "
                f"but {CO2_CAVEAT}"]
    if "co2" not in req.allow or (best is not None and best.mesh_shape.data_parallel == "co2"):
        return []
    c = _first(res.ranked, lambda x: x.data_parallel == "co2")
    if c is not None and best is not None:
        return [f"co2 allowed, not chosen: its best plan ({c.mesh_shape.describe()}) takes {c.step_s:.4g} s against "
                f"{best.step_s:.4g} s" + ("" if c.feasible else f" and does not fit ({'; '.join(c.problems)})")]
    if req.gpus <= req.gpus_per_node:
        return [f"co2 allowed, none applies: all {req.gpus} GPUs are in one node, so no replica all-reduce crosses "
                f"a slow link (co2 is tried where parallel.dp_replicate > 1 puts the replicas on different nodes)"]
    return ["co2 allowed, none applies: no candidate has replicas on different nodes (parallel.dp_replicate > 1 "
            "with whole replicas per node, a dense model or expert degree 1, no qgz) that fits"]


def why(res: PlanResult) -> list[str]:
    """The link levels, why the chosen plan's mode, and co2 beside it."""
    best, req = res.best, res.request
    lines = [links_text(req)]
    if best is not None:
        s = best.mesh_shape
        if s.data_parallel == "co2":
            lines.append(_co2_why(best, _first(res.feasible, lambda x: x.data_parallel == "sync"), req))
            lines += _fewer_local_steps(best, res.feasible)
        elif s.zero_pp:
            lines.append(_zero_pp_why(best, res))
        elif req.gpus > req.gpus_per_node:
            lines.append("plain FSDP: no slow-link mode (ZeRO++, hpZ on a group, co2) predicts a shorter step "
                         "(a tie goes to the exact, simpler plan)")
    return lines + co2_lines(res)


def report(res: PlanResult) -> dict:
    """The JSON's "slow_links": the lines of `why`, the chosen plan's bytes per link level (None where
    bench comm's closed forms do not describe its layout) and the held-out co2 plans."""
    best, req = res.best, res.request
    levels = None if best is None else levels_of(best, req)
    return {"why": why(res), "bytes_per_level": levels,
            "bytes_per_level_scope": SCOPE + " (bench comm's closed forms, costs/link_bytes.py; MoE parts: "
                                     "planner/expert_levels.py); co2's outer all-reduce 1/H per step",
            "co2_plans": [e.as_dict() for e in res.co2_plans[:3]]}


def report_text(res: PlanResult) -> list[str]:
    """The lines `longctx plan` prints under the table."""
    rep = report(res)
    lines = [f"slow links: {line}" for line in rep["why"]]
    levels = rep["bytes_per_level"]
    if levels is None and res.best is not None and res.best.mesh_shape.world > 1:
        best = res.best
        reason = (why_not_described(res.request.model, best.mesh_shape, best.comm_bytes) or
                  "bench comm's closed forms (costs/link_bytes.py) do not describe FSDP groups that do not nest in "
                  "nodes")
        lines.append(f"slow links: bytes per link level not given for {best.mesh_shape.describe()}: {reason}; "
                     f"bytes per mesh dim are in --json's plans")
    if levels:
        lines.append("slow links: bytes per link level, " + ", ".join(
            f"{LEVELS[k]} {v / 1e9:.4g} GB" for k, v in levels.items() if k != "intra_group_bytes" or v) +
            " (of the intra-node, what stays in a group)" * bool(levels["intra_group_bytes"]) +
            f": {SCOPE}")
    return lines
