"""What `longctx plan` prints and writes: the ranked table, JSON, and the best plan as a TOML config
that `longctx train --config` runs unchanged.

The written plan carries the layout, memory policy, batch and sequence length. A plan for GPUs
leaves where and in what precision to train (train.device, train.dtype) as the base config has
them, "auto" unless given: a plan made for h100s also runs on a laptop's CPU (gloo, fp32), only its
predictions are for the hardware its header names."""

from __future__ import annotations

import dataclasses
import json

from ..config import Config, build_config, rules, to_dict, to_toml
from ..errors import ConfigError
from ..parallel.checks import check_layout
from .cost import Estimate
from .model_states import active_params, param_counts, params_text
from .search import PlanResult, Request, step_text

GIB = 2**30


def plan_config(est: Estimate, req: Request, base: Config) -> Config:
    """`base` (model, data, train settings) with the plan's layout, memory policy, batch and sequence
    length: train.global_batch = micro_batch x dp x grad_accum sequences per optimizer step (the
    request's global batch), in train.grad_accum micro-batches."""
    raw = to_dict(base)
    shape = est.mesh_shape
    raw["parallel"].update(dp_replicate=shape.dp_replicate, dp_shard=shape.dp_shard, head=shape.head, ctx=shape.ctx,
                           window=shape.window if shape.window and shape.window < shape.ctx else 0,
                           placement=shape.placement, expert=shape.expert)
    raw["memory"].update(est.policy.to_config())
    global_batch = est.micro_batch * shape.dp * est.grad_accum
    if global_batch != req.global_batch:
        raise ValueError(f"plan {shape.describe()} micro-batch {est.micro_batch} x grad_accum {est.grad_accum} makes "
                         f"{global_batch} sequences per step, not the requested {req.global_batch}")
    raw["train"].update(seq_len=req.seq_len, global_batch=global_batch, grad_accum=est.grad_accum)
    # A plan for GPUs leaves train.device / train.dtype as the base has them ("auto": cuda + bf16 where
    # there is a GPU, else cpu + fp32), so it also runs on a machine without the planned GPUs; a plan
    # for CPU processes (hardware "cpu...") trains on the CPU, which its predictions are for.
    if req.hardware.name.startswith("cpu") and raw["train"]["device"] == "auto":
        raw["train"].update(device="cpu", dtype="fp32" if raw["train"]["dtype"] == "auto" else raw["train"]["dtype"])
    raw["model"]["max_seq_len"] = max(raw["model"]["max_seq_len"], req.seq_len)
    return build_config(raw)


def runnable(cfg: Config, world: int) -> str:
    """'' when `longctx train` accepts `cfg` on `world` ranks (config validation and the layout
    checks it runs before starting any process), else why not."""
    try:
        rules.validate(cfg)
        check_layout(cfg, world)
    except ConfigError as e:
        return str(e)
    return ""


def toml_text(cfg: Config, est: Estimate, req: Request) -> str:
    world = est.mesh_shape.world
    nodes = max(1, world // req.gpus_per_node)
    head = [
        (f"# written by `longctx plan`: {req.model.label}, {req.global_batch} sequences of {req.seq_len:,} tokens "
         f"per step on {world} x {req.hardware.name}"),
        f"# planned for: {hardware_text(req)}",
        (f"# train.device = \"{cfg.train.device}\", train.dtype = \"{cfg.train.dtype}\"" +
         (f": runs where it is trained (GPUs: bf16, else CPU: fp32); predictions are for {req.hardware.name}"
          if cfg.train.device == "auto" else "")),
        (f"# predicted: step {est.step_s:.4g} s, {est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%, "
         f"{est.memory['total'] / GIB:.1f} GiB per GPU, bottleneck {est.bottleneck}"),
        f"# attention work: {doc_work_text(req)}",
        (f"# run: longctx train --config THIS --nproc {world}" if nodes == 1 else
         f"# run: torchrun --nnodes {nodes} --nproc-per-node {req.gpus_per_node} -m longctx train --config THIS"),
        "",
    ]
    return "\n".join(head) + to_toml(cfg)


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def table(res: PlanResult, top: int = 10) -> str:
    req = res.request
    rows = res.feasible[:top] if res.feasible else res.ranked[:top]
    head = ["#", "layout", "memory policy", "micro-batch", "grad_accum", "states", "gathered", "activ.", "transient",
            "total GiB", "host/node", "step s", "tok/s", "MFU", "bottleneck"]
    body = []
    for i, e in enumerate(rows, 1):
        body.append([str(i), e.mesh_shape.describe(), e.policy.describe(), str(e.micro_batch), str(e.grad_accum),
                     _gib(e.memory["model_states"]), _gib(e.memory["gathered_params"]), _gib(e.memory["activations"]),
                     _gib(e.memory["transient"]),
                     _gib(e.memory["total"]), f"{e.host_per_node / GIB:.0f}" if e.host_per_node else "-",
                     step_text(e.step_s), f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%",
                     e.bottleneck if e.feasible else "INFEASIBLE: " + "; ".join(e.problems)])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    intro = (f"{req.model.label} ({params_text(req.model)}): global batch {req.global_batch} x {req.seq_len:,} "
             f"tokens per step on {hardware_text(req)}; "
             f"{res.evaluated} candidates in {res.seconds:.2f} s, {len(res.feasible)} feasible; "
             f"{doc_work_text(req)}; ranked by predicted step time as shown (equal: simpler policy, less memory)")
    return "\n".join([intro, *lines])


def hardware_text(req: Request) -> str:
    """'4 x h100 (80 GiB, 989 TFLOP/s, ...)': the hardware a plan is made for."""
    hw = req.hardware
    return (f"{req.gpus} x {hw.name} ({hw.memory_gib:g} GiB, {hw.peak_tflops:g} TFLOP/s, {req.gpus_per_node} per "
            f"node, {hw.intra_gbps:g}/{hw.inter_gbps:g} GB/s intra/inter, host {hw.host_memory_gib:g} GiB per node)")


def doc_work_text(req: Request) -> str:
    """'doc_work 0.412 (from --store ...)': the attention work the plan assumes, and why."""
    return f"doc_work {round(req.doc_work, 3)!r} ({req.doc_work_source})"


def to_json(res: PlanResult, top: int, written: str | None, note: str = "") -> str:
    req = res.request
    return json.dumps({
        "request": {"model": req.model.label, "parameters": param_counts(req.model)["total"],
                    "active_parameters": active_params(req.model), "gpus": req.gpus, "gpus_per_node": req.gpus_per_node,
                    "seq_len": req.seq_len, "global_batch": req.global_batch,
                    "doc_mask": req.doc_mask, "doc_work": req.doc_work, "doc_work_source": req.doc_work_source,
                    **({"expert_skew": "max" if req.expert_skew == float("inf") else req.expert_skew}
                       if req.model.is_moe else {}),
                    "hardware": dataclasses.asdict(req.hardware)},
        "evaluated": res.evaluated, "search_seconds": res.seconds, "feasible": len(res.feasible),
        "plans": [e.as_dict() for e in (res.feasible or res.ranked)[:top]],
        "suggestions": res.suggestions, "written": written, "note": note,
    }, indent=2)
