"""What `longctx plan` prints and writes: the ranked table, JSON, and the best plan as a TOML config
that `longctx train --config` runs unchanged.

The written plan carries the layout, memory policy, batch and sequence length. A plan for GPUs
leaves where and in what precision to train (train.device, train.dtype) as the base config has
them, "auto" unless given: a plan made for h100s also runs on a laptop's CPU (gloo, fp32), only its
predictions are for the hardware its header names."""

from __future__ import annotations

import dataclasses
import textwrap

from .. import strict_json
from ..config import Config, build_config, rules, to_dict, to_toml
from ..costs.cuda_runtime import CUDA_RUNTIME, CUDA_RUNTIME_BYTES
from ..costs.model_states import param_counts, params_text, predicted_active_params
from ..costs.rank_process import PROCESS, PROCESS_BYTES
from ..errors import ConfigError
from ..job.checks import check_layout
from .cost import Estimate
from .link_report import report
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
                           placement=shape.placement, expert=shape.expert, expert_replicas=shape.expert_replicas,
                           expert_ranks_per_node=shape.expert_ranks_per_node,
                           zero_pp=shape.zero_pp,
                           ranks_per_node=shape.node if shape.zero_pp else 0, hpz_ranks=shape.hpz_ranks)
    raw["memory"].update(est.policy.to_config(), model_states=est.model_states)
    global_batch = est.micro_batch * shape.dp * est.grad_accum
    if global_batch != req.global_batch:
        raise ValueError(f"plan {shape.describe()} micro-batch {est.micro_batch} x grad_accum {est.grad_accum} makes "
                         f"{global_batch} sequences per step, not the requested {req.global_batch}")
    raw["train"].update(seq_len=req.seq_len, global_batch=global_batch, grad_accum=est.grad_accum)
    if shape.data_parallel == "co2":  # chosen only under --allow co2 (planner/slow_links.py)
        raw["train"].update(data_parallel="co2", co2_local_steps=shape.local_steps)
    # A plan for GPUs leaves train.device / train.dtype as the base has them ("auto": cuda + bf16 where
    # there is a GPU, else cpu + fp32), so it also runs on a machine without the planned GPUs; a plan
    # for CPU processes (hardware "cpu...") trains on the CPU, which its predictions are for.
    if req.hardware.is_cpu and raw["train"]["device"] == "auto":  # (the planner's own test, any case: cost.py)
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


def micro_batch_terms(m) -> list[str]:
    """The MoE settings of model `m` whose result depends on which sequences share a micro-batch: the
    balancing loss's statistics, a capacity's drops and the Sinkhorn router's assignment are taken over
    every token of the micro-batch, all its data-parallel rows (docs/moe.md). With any of them, two plans
    of one request that split the global batch into micro-batches of other sizes (dp x micro-batch
    sequences, global batch / grad_accum) train other objectives, not other layouts of one."""
    if not m.is_moe:
        return []
    terms = [f"moe.aux_loss = {m.moe_aux_loss:g} (the balancing loss)"] if m.moe_aux_loss > 0 else []
    if m.moe_capacity_factor > 0:
        terms.append(f"moe.capacity_factor = {m.moe_capacity_factor:g} (which choices are dropped)")
    if m.moe_router == "sinkhorn":
        terms.append("moe.router = sinkhorn (its balanced assignment)")
    return terms


def _terms_are(terms: list[str]) -> str:
    """micro_batch_terms as the subject of a sentence: 'A is' / 'A and B are'."""
    return f"{' and '.join(terms)} {'are' if len(terms) > 1 else 'is'}"


def micro_batch_sequences(est: Estimate) -> int:
    """Sequences of one micro-batch over the job: every data-parallel rank's micro-batch."""
    return est.micro_batch * est.mesh_shape.dp


def micro_batch_note(res: PlanResult, top: int = 10) -> str:
    """'' for a model whose training does not depend on the micro-batch's size (micro_batch_terms), else
    what the listed plans' sizes are and why a plan with another trains something else."""
    terms = micro_batch_terms(res.request.model)
    if not terms:
        return ""
    sizes = sorted({micro_batch_sequences(e) for e in _rows(res, top)})
    text = (f"note: {res.request.model.label}'s {_terms_are(terms)} computed over each micro-batch's tokens, all "
            f"its data-parallel rows (docs/moe.md), so a plan trains the objective of its micro-batch size, dp x "
            f"micro-batch sequences (global batch / grad_accum): "
            + (f"the plans listed take {', '.join(map(str, sizes))} sequences per micro-batch and do not train "
               f"the same model; compare plans of one size (--json: micro_batch_sequences)" if len(sizes) > 1 else
               f"the plans listed all take {sizes[0]} sequences per micro-batch; a run with another number of "
               f"sequences per micro-batch trains another objective"))
    return textwrap.fill(text, width=100, break_on_hyphens=False)


def toml_text(cfg: Config, est: Estimate, req: Request) -> str:
    world = est.mesh_shape.world
    nodes = max(1, world // req.gpus_per_node)
    terms = micro_batch_terms(req.model)
    head = [
        (f"# written by `longctx plan`: {req.model.label}, {req.global_batch} sequences of {req.seq_len:,} tokens "
         f"per step on {world} x {req.hardware.name}"),
        f"# planned for: {hardware_text(req)}",
        (f"# train.device = \"{cfg.train.device}\", train.dtype = \"{cfg.train.dtype}\"" +
         (f": runs where it is trained (GPUs: bf16, else CPU: fp32); predictions are for {req.hardware.name}"
          if cfg.train.device == "auto" else "")),
        (f"# predicted: step {est.step_s:.4g} s, {est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%, "
         f"{est.memory['total'] / GIB:.1f} GiB per GPU, {est.host_per_node / GIB:.1f} GiB of host memory per node "
         f"(model states: {est.model_states}), bottleneck {est.bottleneck}"),
        f"# attention work: {doc_work_text(req)}",
        *([f"# micro-batch: {micro_batch_sequences(est)} sequences over the job (dp {est.mesh_shape.dp} x micro-batch "
           f"{est.micro_batch}), which {_terms_are(terms)} computed over: "
           f"another size trains another objective"] if terms else []),
        (f"# run: longctx train --config THIS --nproc {world}" if nodes == 1 else
         f"# run: torchrun --nnodes {nodes} --nproc-per-node {req.gpus_per_node} -m longctx train --config THIS"),
        "",
    ]
    return "\n".join(head) + to_toml(cfg)


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


# The table's memory columns: the terms of Estimate.memory (costs/host_bytes.py device_bytes_with; its "total" is
# their sum) in the order they are summed, each with its heading and what it holds (the legend under the table).
MEMORY_TERMS = {
    "model_states": ("states", "fp32 parameters, gradients and Adam moments, sharded over the FSDP group, as far as "
                               "their tier (states in) keeps them on the GPU"),
    "gathered_params": ("gathered", "what FSDP holds unsharded (two units' parameters, one unit's fp32 gradient, "
                                    "the root; a unit is parallel.grad_bucket_blocks blocks, 1 by default)"),
    "accumulated_grads": ("acc.grads", "every gradient, unsharded fp32, accumulated over the grad_accum "
                                       "micro-batches (grad_sync step; gs-micro reduces each and has none)"),
    "activations": ("activ.", "saved activations on the GPU (those offloaded are in host/node, GiB per node)"),
    "transient": ("transient", "the working set of one block's backward and of the LM head on top of them"),
    "co2_state": ("co2", "train.data_parallel = co2's fp32 copies of the rank's shard: the round's start, the outer "
                         "model, the change in flight"),
}


def memory_terms(rows: list[Estimate]) -> list[str]:
    """The memory terms any of `rows` has, in summing order; a term MEMORY_TERMS does not know yet
    (one device_bytes_with adds) comes last, under its own name, so the columns still add up."""
    present = dict.fromkeys(k for e in rows for k in e.memory if k != "total")
    return [k for k in MEMORY_TERMS if k in present] + [k for k in present if k not in MEMORY_TERMS]


def _term_heading(key: str) -> str:
    return MEMORY_TERMS[key][0] if key in MEMORY_TERMS else key


def memory_legend(res: PlanResult, top: int = 10) -> str:
    """What each memory column of the table holds, wrapped at 100 columns like the command's errors."""
    rows = _rows(res, top)
    terms = memory_terms(rows)
    text = ("memory per GPU in GiB, each figure rounded to 0.1, the terms adding up to the total within rounding: " +
            "; ".join(f"{_term_heading(k)} = {MEMORY_TERMS[k][1]}" if k in MEMORY_TERMS else k for k in terms) +
            ". states in = memory.model_states (device; host_optimizer: fp32 weights on the GPU, master copy, "
            "gradients and moments in host memory, AdamW on the host; host: all of them in host memory). "
            "host/GPU, host/node = host memory in GiB per rank and per node: a host tier's states, offloaded "
            "activations, the data loader's batches" + _per_rank_legend(rows) + _zero_pp_legend(rows))
    return textwrap.fill(text, width=100, break_on_hyphens=False)


def _per_rank_legend(rows: list[Estimate]) -> str:
    """The host columns' per-rank parts (planner/cost.py footprint_of): each rank's interpreter ("process"), and on
    GPU hardware its CUDA runtime; with the states on the device and nothing offloaded they are most of host/node."""
    text = ""
    if any(PROCESS in e.host for e in rows):
        text += (f", each rank's interpreter with torch and longctx imported (process: {PROCESS_BYTES / 2**30:.2f} "
                 "GiB, costs/rank_process.py)")
    if any(CUDA_RUNTIME in e.host for e in rows):
        text += (f", each GPU rank's CUDA context and libraries ({CUDA_RUNTIME_BYTES / 2**30:.2f} GiB: "
                 "costs/cuda_runtime.py)")
    return text + (", the same parts the preflight of `longctx train` counts for the ranks it starts" if text else "")


def _zero_pp_legend(rows: list[Estimate]) -> str:
    """Why a plan's layout says hpz / qwz / qgz (parallel.zero_pp), /gN (hpz_ranks) or co2/HN, when one does."""
    text = ""
    if any(e.mesh_shape.zero_pp for e in rows):
        text += (". hpz, qwz, qgz in a layout = parallel.zero_pp (ZeRO++), tried where the FSDP group spans nodes: "
                 "hpz keeps each block's weights sharded within the node after its forward (backward's gather stays "
                 "in the node; gathered includes that copy), qwz gathers weights and qgz reduces gradients as int8 "
                 "blocks (about a quarter of fp32's bytes across nodes; lossy, so a tie goes to plain FSDP)")
    if any(e.mesh_shape.hpz_ranks for e in rows):
        text += "; /gN = parallel.hpz_ranks N: hpz on a node's group of N ranks (three-level hardware)"
    if any(e.mesh_shape.data_parallel == "co2" for e in rows):
        text += (". co2/HN in a layout = train.data_parallel co2 with N local steps per round (train.co2_local_steps; "
                 "ranked under --allow co2 only: it changes convergence)")
    return text


def _rows(res: PlanResult, top: int) -> list[Estimate]:
    return res.feasible[:top] if res.feasible else res.ranked[:top]


def table(res: PlanResult, top: int = 10) -> str:
    """The intro line, the heading and one row per plan. The memory columns are every term of the
    plan's memory dict, the one its total is summed from, so they add up to the total shown after
    them (within rounding); the heading writes them as that sum."""
    req = res.request
    rows = _rows(res, top)
    terms = memory_terms(rows)
    first_mem, last_mem = 6, 6 + len(terms)  # column indices of the first memory term and of the total
    head = ["#", "layout", "memory policy", "states in", "micro-batch", "grad_accum", *map(_term_heading, terms),
            "total GiB", "host/GPU", "host/node", "step s", "tok/s", "MFU", "bottleneck"]
    body = []
    for i, e in enumerate(rows, 1):
        body.append([str(i), e.mesh_shape.describe(), e.policy.describe(), e.model_states, str(e.micro_batch),
                     str(e.grad_accum), *(_gib(e.memory[k]) if k in e.memory else "-" for k in terms),
                     _gib(e.memory["total"]), _gib(e.host.get("total", 0.0)), f"{e.host_per_node / GIB:.1f}",
                     step_text(e.step_s), f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%",
                     e.bottleneck if e.feasible else "INFEASIBLE: " + "; ".join(e.problems)])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cells: list[str], is_head: bool) -> str:
        out = cells[0].ljust(widths[0])
        for i in range(1, len(cells)):
            if first_mem < i <= last_mem:  # inside the memory sum: "states + gathered + ... = total GiB"
                sep = (" = " if i == last_mem else " + ") if is_head else "   "
            else:
                sep = "  "
            numeric = first_mem <= i <= last_mem and not is_head  # right-aligned, so the decimals line up
            out += sep + (cells[i].rjust(widths[i]) if numeric else cells[i].ljust(widths[i]))
        return out.rstrip()

    intro = (f"{req.model.label} ({params_text(req.model)}): global batch {req.global_batch} x {req.seq_len:,} "
             f"tokens per step on {hardware_text(req)}; "
             f"{res.evaluated} candidates in {res.seconds:.2f} s, {len(res.feasible)} feasible ({res.timed} timed: "
             f"the rest cannot come before these rows); "
             f"{doc_work_text(req)}; ranked by predicted step time as shown (equal: simpler policy, less memory)")
    return "\n".join([intro, line(head, True), *(line(r, False) for r in body)])


def hardware_text(req: Request) -> str:
    """'4 x h100 (80 GiB, 989 TFLOP/s, ...)': the hardware a plan is made for."""
    hw = req.hardware
    return (f"{req.gpus} x {hw.name} ({hw.memory_gib:g} GiB, {hw.peak_tflops:g} TFLOP/s, {req.gpus_per_node} per "
            f"node, {hw.intra_gbps:g}/{hw.inter_gbps:g} GB/s intra/inter, " +
            (f"groups of {hw.group_ranks} linked at {hw.middle_gbps:g} GB/s, " if hw.group_ranks else "") +
            f"host {hw.host_memory_gib:g} GiB per node)")


def doc_work_text(req: Request) -> str:
    """'doc_work 0.412 (from --store ...)': the attention work the plan assumes, and why."""
    return f"doc_work {round(req.doc_work, 3)!r} ({req.doc_work_source})"


def to_json(res: PlanResult, top: int, written: str | None, note: str = "") -> str:
    req = res.request
    plans = [{**e.as_dict(), "micro_batch_sequences": micro_batch_sequences(e)}
             for e in (res.feasible or res.ranked)[:top]]
    slow_links = report(res)  # (after the plans: they are timed first)
    return strict_json.dumps({
        "request": {"model": req.model.label, "parameters": param_counts(req.model)["total"],
                    "active_parameters": predicted_active_params(req.model), "gpus": req.gpus,
                    "gpus_per_node": req.gpus_per_node,
                    "seq_len": req.seq_len, "global_batch": req.global_batch,
                    "doc_mask": req.doc_mask, "doc_work": req.doc_work, "doc_work_source": req.doc_work_source,
                    **({"expert_skew": "max" if req.expert_skew == float("inf") else req.expert_skew}
                       if req.model.is_moe else {}),
                    "hardware": dataclasses.asdict(req.hardware)},
        "evaluated": res.evaluated, "search_seconds": res.seconds, "feasible": len(res.feasible), "timed": res.timed,
        "plans": plans, "suggestions": res.suggestions, "written": written, "note": note, "slow_links": slow_links,
        "micro_batch_dependent": micro_batch_terms(req.model),
    }, indent=2)
