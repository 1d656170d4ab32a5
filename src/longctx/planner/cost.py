"""Analytic cost of one training configuration: memory per GPU by part, bytes per mesh dim,
compute time, exposed communication, step time, tokens/s and MFU.

`estimate` puts together named formulas, each in the module of its kind and testable alone:

- model-state memory (costs/model_states.py): fp32 parameters, gradients and two Adam moments
  sharded over the FSDP group, the blocks and root FSDP holds gathered, and the unsharded fp32
  gradients accumulated between micro-batches under grad_sync "step";
- activation memory: `memory.accounting.estimate_activations` (the formulas `longctx bench memory`
  is compared with to the byte), plus `memory.transients.transient_bytes`, the working set of one
  block's backward and of the LM head on top of it; host memory per node for offloaded activations
  and attention state (`attention_offload_host_and_traffic`), each rank's interpreter with torch and longctx
  imported (costs/rank_process.py, part "process") and on a GPU its CUDA context and libraries
  (costs/cuda_runtime.py): the parts train's preflight counts for the ranks it starts;
- communication bytes (planner/comm_bytes.py, from parallel/context/volumes.py, the closed forms comm.py's
  counters are tested to equal): attention's `attention_bytes` times the layers, the micro-batches and, under full
  recomputation, the forward once more; document ids cost no bytes (the training loop plans each
  batch's sequence layout on the host from the ids every rank already has, parallel/context/shares.py local_batch,
  and the layout travels with the local ids to the attention core); FSDP's `fsdp_bytes_per_step`,
  the same function the training loop's metrics line reports (FSDP's collectives bypass comm.py's
  counters; `job/traffic.py library_traffic()` counts them, and tests/distributed/test_fsdp_bytes.py
  compares a real step with this figure); under expert parallelism the MoE layers' all-to-alls
  (`expert_bytes`, even routing) and their time on the most loaded rank (costs/timing.py);
- FLOPs and time (costs/timing.py): metrics.py's model FLOPs (the attention s^2 term halved under
  the causal mask), plus recomputation; with document masks the attention FLOPs are scaled by
  `doc_work`, the visible (causal, same-document) query-key pairs over those of a plain causal
  mask (planner/documents.py; 1.0 = one document per sequence, the default; `longctx plan --store`
  measures it). MFU keeps metrics.py's causal model FLOPs (what the training metrics line
  reports), so with doc_work < 1 it is an upper bound there and here alike; exposed communication
  as costs/timing.py describes;
- train.data_parallel = co2 (planner/slow_links.py): no replica gradient all-reduce per step, the outer
  all-reduce's exposed share per step ("exposed_co2_outer") and OuterSync's fp32 copies ("co2_state").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..costs.cuda_runtime import CUDA_RUNTIME, with_cuda_runtime
from ..costs.hardware import Hardware
from ..costs.hier_bytes import exposed_hier_seconds
from ..costs.host_bytes import (
    device_bytes_with,
    device_parts_before_activations,
    exposed_host_state_seconds,
    host_bytes_with,
    host_parts_but_offloaded,
    one_memory_bytes,
)
from ..costs.rank_process import PROCESS, with_process
from ..costs.shape import MeshShape
from ..costs.timing import (
    Flops,
    exposed_attention_offload_seconds,
    exposed_expert_seconds,
    exposed_fsdp_seconds,
    exposed_head_seconds,
    exposed_offload_seconds,
    exposed_ring_seconds,
    layer_attention_seconds,
    model_flops_per_token,
    predicted_block_forward_seconds,
    recompute_share,
)
from ..memory.accounting import ActivationEstimate
from ..memory.hier_counts import hierarchical
from ..memory.moe_counts import max_expert_skew
from ..memory.policy import MemoryPolicy
from .activation_costs import ActivationCosts, activation_costs
from .comm_bytes import attention_call_bytes, comm_bytes_per_step
from .expert_copies import copy_relief, copy_seconds
from .slow_links import CO2_LOCAL_STEPS, co2_exposed_seconds, co2_local_steps, co2_outer_seconds


@dataclass
class Estimate:
    mesh_shape: MeshShape
    policy: MemoryPolicy
    micro_batch: int                   # sequences per data-parallel rank per micro-batch
    grad_accum: int                    # micro-batches per optimizer step
    seq_len: int                       # tokens per sequence
    global_batch: int                  # sequences per optimizer step over the whole job
    memory: dict[str, float]           # bytes per GPU (rank) by part, and "total"
    host_per_node: float               # bytes of host memory per node: every rank's `host` total
    comm_bytes: dict[str, dict[str, float]]  # per rank per optimizer step: {dim: {label: bytes}}
    times: dict[str, float]            # seconds per step: compute, exposed parts, step
    tokens_per_s: float
    mfu: float
    bottleneck: str
    feasible: bool
    problems: list[str] = field(default_factory=list)
    doc_work: float = 1.0              # attention work with documents / plain causal (documents.py)
    model_states: str = "device"       # memory.model_states: device | host_optimizer | host
    host: dict[str, float] = field(default_factory=dict)  # host bytes per rank by part (costs/host_bytes.py)

    @property
    def step_s(self) -> float:
        return self.times["step"]

    def policy_text(self) -> str:
        """The memory policy as the table shows it, the model-state tier added when it is not device's."""
        text = self.policy.describe()
        return text if self.model_states == "device" else f"{text} states:{self.model_states}"

    def as_dict(self) -> dict:
        shape, policy = self.mesh_shape, self.policy
        return {
            "layout": {"dp_replicate": shape.dp_replicate, "dp_shard": shape.dp_shard, "head": shape.head,
                       "ctx": shape.ctx, "window": shape.window, "placement": shape.placement, "expert": shape.expert,
                       "expert_replicas": shape.expert_replicas, "expert_ranks_per_node": shape.expert_ranks_per_node,
                       "zero_pp": shape.zero_pp, "hpz_ranks": shape.hpz_ranks,
                       "data_parallel": shape.data_parallel, "co2_local_steps": shape.local_steps},
            "policy": {**policy.to_config(), "model_states": self.model_states},
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "memory_gib": {k: v / 2**30 for k, v in self.memory.items()},
            "host_per_node_gib": self.host_per_node / 2**30,
            "host_gib": {k: v / 2**30 for k, v in self.host.items()},
            "comm_bytes_per_step": self.comm_bytes, "times_s": self.times,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bottleneck": self.bottleneck,
            "feasible": self.feasible, "problems": self.problems, "doc_work": self.doc_work,
            "describe": f"{shape.describe()} | {self.policy_text()} | micro-batch {self.micro_batch}",
        }


@dataclass(frozen=True)
class RunSettings:
    """Settings the written plan keeps from the user's config overrides, costed as the run uses them
    (planner/cli.py reads them; those it cannot cost it refuses before planning)."""
    async_checkpoint: bool = False     # checkpoint.async: DCP's host staging of the states
    co2_outer_momentum: bool = False   # train.co2_outer_momentum > 0: one more fp32 buffer per parameter
    co2_overlap_steps: int = 0         # train.co2_overlap_steps: steps the outer all-reduce hides under (0: H)
    grad_bucket_blocks: int = 1        # parallel.grad_bucket_blocks: blocks per FSDP unit
    zero_pp_block: int = 512           # parallel.zero_pp_block: elements per int8 block under qwz / qgz


# ----------------------------------------------------------------------------------------------
# Memory


def gib_text(nbytes: float) -> str:
    """Bytes as GiB for a message: 0.1 GiB steps, and 3 significant digits below 1 GiB, where 0.1 steps made a
    small device's reason read "needs 0.0 GiB per GPU, 0.0 usable of 0.01"."""
    g = nbytes / 2**30
    return f"{g:.1f}" if g >= 0.95 else f"{g:.3g}"


# host parts every run holds, whatever its memory settings (memory_problems: not refused where hardware names no
# host memory)
EVERY_RUN = ("data_loader", PROCESS, CUDA_RUNTIME)


def memory_problems(memory: dict[str, float], host: dict[str, float], ranks_per_node: int,
                    hw: Hardware, one_memory: float = 0.0) -> list[str]:
    """What does not fit: GPU memory, host memory per node (`host`: one rank's by part). one_memory: on a
    CPU (hw.is_cpu), the peak of a run there (costs/host_bytes.py one_memory_bytes: the foreach AdamW's step,
    and the host bytes in the same memory where the hardware has none of its own), the figure `longctx
    train`'s preflight checks; it must fit the process's share too."""
    problems = []
    if memory["total"] > hw.usable_memory_bytes:
        problems.append(f"needs {gib_text(memory['total'])} GiB per GPU, {gib_text(hw.usable_memory_bytes)} "
                        f"usable of {hw.memory_gib:g}")
    elif one_memory > hw.usable_memory_bytes:
        problems.append(f"needs {gib_text(one_memory)} GiB of this CPU's memory per process, "
                        f"{gib_text(hw.usable_memory_bytes)} usable of {hw.memory_gib:g}: a CPU run's foreach AdamW "
                        f"step holds 20 bytes per parameter under memory.model_states = device, and without host "
                        f"memory of its own its host bytes share that memory (costs/host_bytes.py "
                        f"one_memory_bytes, what the preflight of `longctx train` checks)")
    per_node = host["total"] * ranks_per_node
    # hardware that names no host memory (0: a CPU calibration, test hardware) still refuses offload
    # and host-tier states, but not the data loader's batches, the interpreter or the CUDA runtime every run holds
    every_run = sum(host.get(k, 0.0) for k in EVERY_RUN)
    checked = per_node if hw.host_memory_gib else (host["total"] - every_run) * ranks_per_node
    if checked > hw.usable_host_bytes and not hw.host_memory_gib:  # (was "needs 0.0 GiB ... (), 0.0 usable of 0")
        parts = ", ".join(f"{k.replace('_', ' ')} {v * ranks_per_node / 2**20:,.1f} MiB" for k, v in host.items()
                          if k not in ("total", *EVERY_RUN) and v > 0)
        problems.append(f"keeps {checked / 2**20:,.1f} MiB in host memory per node ({parts}), but hardware {hw.name} "
                        f"has no host memory (host_memory_gib = 0): plan without host memory (--model-states device "
                        f"--offload none), or give it (--hw host_memory_gib=GIB --hw usable_host_fraction=0.8)")
    elif checked > hw.usable_host_bytes:
        parts = ", ".join(f"{k.replace('_', ' ')} {v * ranks_per_node / 2**30:.1f}"
                          for k, v in host.items() if k != "total" and v >= 2**30 / 10)
        problems.append(f"needs {per_node / 2**30:.1f} GiB of host memory per node ({parts}), "
                        f"{hw.usable_host_bytes / 2**30:.1f} usable of {hw.host_memory_gib:g}")
    return problems


# ----------------------------------------------------------------------------------------------
# Time


def exposed_per_micro_batch(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, calls: tuple[dict, dict],
                            flops: Flops, acts: ActivationEstimate, attn_traffic: float, hw: Hardware,
                            gpus_per_node: int) -> dict[str, float]:
    """Seconds of communication compute does not hide, per micro-batch, by kind (FSDP's is per step)."""
    per_call, refwd = calls
    block_fwd = predicted_block_forward_seconds(flops, m, hw)
    layer_attn = layer_attention_seconds(flops, m, hw)
    return {
        "head": exposed_head_seconds(m, shape, policy, per_call, refwd, hw, gpus_per_node),
        "ctx": exposed_ring_seconds(m, shape, policy, per_call, layer_attn, hw, gpus_per_node),
        "offload": exposed_offload_seconds(m, policy, acts, block_fwd, hw),
        "attention_offload": exposed_attention_offload_seconds(m, policy, attn_traffic, layer_attn, hw),
    }


def step_times(compute: float, exposed: dict[str, float], fsdp_step: float, grad_accum: int,
               per_step: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds per optimizer step: compute, each exposed kind (`exposed` per micro-batch, `per_step`
    per optimizer step: the model states' host link and host AdamW), and the step."""
    per_step = per_step or {}
    step = grad_accum * (compute + sum(exposed.values())) + fsdp_step + sum(per_step.values())
    return {"compute": grad_accum * compute, **{f"exposed_{k}": grad_accum * v for k, v in exposed.items()},
            "exposed_fsdp": fsdp_step, **{f"exposed_{k}": v for k, v in per_step.items()}, "step": step}


def bottleneck(compute: float, exposed: dict[str, float], fsdp_step: float, grad_accum: int, policy: MemoryPolicy,
               flops: Flops, acts: ActivationEstimate, per_step: dict[str, float] | None = None) -> str:
    """The largest part of the step, naming recomputation's share of compute when it is over 15%."""
    per_step = per_step or {}
    parts = {"compute": grad_accum * compute, "head all-to-all": exposed["head"] * grad_accum,
             "ring (ctx)": exposed["ctx"] * grad_accum, "fsdp": fsdp_step,
             "expert all-to-all": (exposed["expert"] + exposed.get("expert_copies", 0.0)) * grad_accum,
             "offload copies": (exposed["offload"] + exposed["attention_offload"]) * grad_accum,
             "host link (states)": per_step.get("host_link", 0.0), "host AdamW": per_step.get("host_adam", 0.0),
             "co2 outer all-reduce": per_step.get("co2_outer", 0.0)}
    name = max(parts, key=parts.get)
    if name == "compute" and policy.recompute != "none" and acts.recompute_flops:
        share = recompute_share(flops)
        if share > 0.15:
            name = f"compute ({100 * share:.0f}% recompute)"
    return name


def planned_skew(m: ModelConfig, shape: MeshShape, expert_skew: float) -> float:
    """The receive skew a layout is timed and sized at: the request's, at most what routing allows at its expert
    degree (memory/moe_counts.py max_expert_skew); 1 without expert parallelism."""
    return min(expert_skew, max_expert_skew(m, shape.expert)) if shape.expert > 1 else 1.0


def exposed_expert_parts(m: ModelConfig, hw: Hardware, shape: MeshShape, comm: dict[str, dict[str, float]],
                         grad_accum: int, tokens: int, skew: float, gpus_per_node: int) -> dict[str, float]:
    """Seconds per micro-batch of the expert all-to-alls on the most loaded rank ("expert") and, with FlexMoE's
    copies, of their fetches ("expert_copies", first), from a step's `comm` bytes (comm_bytes_per_step, or its
    expert dims alone: comm_bytes.expert_step_bytes) at the planned `skew`. `timed` and the search's lower bound
    (planner/step_bound.py) both time them here, so the bound's term is this figure, not a second formula."""
    out: dict[str, float] = {}
    rows = comm.get("expert", {})
    if shape.expert_replicas:  # FlexMoE's copies: the rank timed at the skew they leave, their fetches apart
        copies = rows.get("expert_copies", 0.0)
        rows = {k: v for k, v in rows.items() if k != "expert_copies"}
        out["expert_copies"] = copy_seconds(copies / grad_accum, shape, hw, gpus_per_node)
        skew = copy_relief(m.moe_experts, shape.expert, shape.expert_replicas, skew).skew
    if hierarchical(shape.expert, shape.expert_ranks_per_node):  # its two levels, each over its own link
        out["expert"] = exposed_hier_seconds(m, shape, comm, grad_accum, tokens, skew, hw, gpus_per_node)
    else:
        out["expert"] = exposed_expert_seconds(m, shape, rows, grad_accum, tokens, skew, hw, gpus_per_node)
    return out


def _co2_settled(m: ModelConfig, shape: MeshShape, hw: Hardware, gpus_per_node: int, step_compute: float,
                 tried: tuple[int, ...], overlap: int = 0, states: dict | None = None) -> tuple[MeshShape, float]:
    """(shape, seconds per step of CO2's outer all-reduce the local steps do not hide: those before its
    merge, `overlap` = train.co2_overlap_steps, 0 = all H); a co2 shape without local_steps gets the
    smallest of `tried` that hides it. (shape, 0.0) under sync. states: footprint_of's dict of the layout
    (`shape`'s, with `gpus_per_node`), where the all-reduce's seconds, a function of those alone, are kept."""
    if shape.data_parallel != "co2":
        return shape, 0.0
    allreduce = None if states is None else states.get("co2_allreduce")
    if allreduce is None:
        allreduce = co2_outer_seconds(m, shape, hw, gpus_per_node)
        if states is not None:
            states["co2_allreduce"] = allreduce
    if not shape.local_steps:
        shape = dataclasses.replace(shape, local_steps=co2_local_steps(allreduce, step_compute, hw, tried, overlap))
    return shape, co2_exposed_seconds(allreduce, step_compute, shape.local_steps, hw, overlap)


# ----------------------------------------------------------------------------------------------
# The estimate


@dataclass
class Footprint:
    """A candidate before its time: what it holds in GPU and host memory, and whether that fits; its
    compute seconds per micro-batch, which bound its step time from below (`lower_bound_s`)."""
    mesh_shape: MeshShape              # co2's local steps settled
    policy: MemoryPolicy
    micro_batch: int
    grad_accum: int
    tokens: int                        # per rank per micro-batch
    work: float                        # doc_work as applied
    acts: ActivationEstimate
    transient: float
    flops: Flops
    compute: float                     # seconds per micro-batch
    co2_outer: float
    memory: dict[str, float]
    host: dict[str, float]             # per rank
    host_per_node: float
    attn_traffic: float
    problems: list[str]
    model_states: str

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def lower_bound_s(self) -> float:
        """The step's compute alone: every other term of the step (step_times) is a non-negative
        addition to it, so no step of this candidate is shorter."""
        return self.grad_accum * self.compute


def footprint(m: ModelConfig, hw: Hardware, shape: MeshShape, policy: MemoryPolicy, *, seq_len: int,
              global_batch: int, micro_batch: int = 1, gpus_per_node: int = 8, doc_mask: bool = True,
              doc_work: float = 1.0, acts: ActivationEstimate | None = None,
              transient: float | None = None, expert_skew: float = 1.0, model_states: str = "device",
              co2_steps: tuple[int, ...] = CO2_LOCAL_STEPS, settings: RunSettings = RunSettings()) -> Footprint:
    """`estimate`'s first half: memory, host memory, compute, and what does not fit (its arguments)."""
    costs = activation_costs(m, hw, shape, policy, seq_len=seq_len, micro_batch=micro_batch, doc_mask=doc_mask,
                             doc_work=doc_work, acts=acts, transient=transient, expert_skew=expert_skew,
                             model_states=model_states)
    return footprint_of(m, hw, shape, policy, costs, seq_len=seq_len, global_batch=global_batch,
                        micro_batch=micro_batch, gpus_per_node=gpus_per_node, doc_mask=doc_mask,
                        model_states=model_states, co2_steps=co2_steps, settings=settings)


def state_parts(m: ModelConfig, hw: Hardware, shape: MeshShape, model_states: str, grad_sync: str, grad_accum: int, *,
                seq_len: int, micro_batch: int, doc_mask: bool, settings: RunSettings) -> tuple[tuple, tuple]:
    """(device_parts_before_activations, host_parts_but_offloaded) of a candidate: what it holds that its
    activations do not change (a function of these arguments alone)."""
    device = device_parts_before_activations(m, shape, model_states, grad_sync, grad_accum, hw.dtype_bytes,
                                             settings.grad_bucket_blocks, settings.co2_outer_momentum)
    host = host_parts_but_offloaded(m, shape, model_states, seq_len=seq_len, micro_batch=micro_batch,
                                    grad_accum=grad_accum, doc_mask=doc_mask, pinned=not hw.is_cpu,
                                    async_checkpoint=settings.async_checkpoint,
                                    co2_momentum=settings.co2_outer_momentum)
    return device, host


def kept_state_parts(states: dict | None, m: ModelConfig, hw: Hardware, shape: MeshShape, model_states: str,
                     grad_sync: str, grad_accum: int, *, seq_len: int, micro_batch: int, doc_mask: bool,
                     settings: RunSettings) -> tuple[tuple, tuple]:
    """state_parts of a candidate, kept in `states` (a dict the caller keeps for one layout, before co2 settles
    its local steps, and micro-batch; None: computed) by (local steps, tier, grad_sync): with the layout and the
    micro-batch those fix every argument of state_parts."""
    key = (shape.local_steps, model_states, grad_sync)
    parts = None if states is None else states.get(key)
    if parts is None:
        parts = state_parts(m, hw, shape, model_states, grad_sync, grad_accum, seq_len=seq_len,
                            micro_batch=micro_batch, doc_mask=doc_mask, settings=settings)
        if states is not None:
            states[key] = parts
    return parts


def footprint_of(m: ModelConfig, hw: Hardware, shape: MeshShape, policy: MemoryPolicy, costs: ActivationCosts, *,
                 seq_len: int, global_batch: int, micro_batch: int, gpus_per_node: int, doc_mask: bool,
                 model_states: str, co2_steps: tuple[int, ...], settings: RunSettings,
                 states: dict | None = None) -> Footprint:
    """footprint from the candidate's ActivationCosts. states: kept_state_parts' dict for the candidate's layout
    and micro-batch (None: computed)."""
    problems: list[str] = []
    if global_batch % (shape.dp * micro_batch):
        problems.append(f"global batch {global_batch} is not divisible by dp {shape.dp} x micro-batch {micro_batch}")
    grad_accum = max(1, global_batch // (shape.dp * micro_batch))
    ranks_per_node = min(gpus_per_node, shape.world)
    shape, co2_outer = _co2_settled(m, shape, hw, gpus_per_node, grad_accum * costs.compute, co2_steps,
                                    settings.co2_overlap_steps, states)
    parts = kept_state_parts(states, m, hw, shape, model_states, policy.grad_sync, grad_accum, seq_len=seq_len,
                             micro_batch=micro_batch, doc_mask=doc_mask, settings=settings)
    memory = device_bytes_with(parts[0], costs.acts.total_device, costs.transient)
    # each rank's interpreter, and each GPU rank's CUDA context and libraries, as the preflight counts them
    host = with_process(host_bytes_with(parts[1], costs.acts_host, costs.attn_host))
    if not hw.is_cpu:
        host = with_cuda_runtime(host)
    # a CPU run's peak as the preflight counts it: its foreach AdamW's step, and where the hardware has no host
    # memory of its own (a calibration: one memory), the host bytes in the same memory as the device's
    one_memory = one_memory_bytes(m, shape, model_states, memory, {"total": 0.0} if hw.host_memory_gib else host,
                                  grad_accum) if hw.is_cpu else 0.0
    problems += memory_problems(memory, host, ranks_per_node, hw, one_memory)
    return Footprint(shape, policy, micro_batch, grad_accum, costs.tokens, costs.work, costs.acts, costs.transient,
                     costs.flops, costs.compute, co2_outer, memory, host, host["total"] * ranks_per_node,
                     costs.attn_traffic, problems, model_states)


def estimate(m: ModelConfig, hw: Hardware, shape: MeshShape, policy: MemoryPolicy, *, seq_len: int,
             global_batch: int, micro_batch: int = 1, gpus_per_node: int = 8, doc_mask: bool = True,
             doc_work: float = 1.0, acts: ActivationEstimate | None = None,
             transient: float | None = None, expert_skew: float = 1.0, model_states: str = "device",
             co2_steps: tuple[int, ...] = CO2_LOCAL_STEPS, settings: RunSettings = RunSettings()) -> Estimate:
    """Cost of one optimizer step of `global_batch` sequences of `seq_len` tokens (over the whole
    job) under `shape` and `policy`, `micro_batch` sequences per data-parallel rank per micro-batch
    (so global_batch / (dp x micro_batch) micro-batches per step), the model states in
    `model_states`'s tier. doc_work: the documents' visible query-key pairs over a plain causal
    mask's (planner/documents.py), in (0, 1]; ignored (1.0) without document masks. acts,
    transient: `rank_activations`, when the caller has them. A co2 shape without local_steps takes the
    smallest of `co2_steps` that hides its outer all-reduce (slow_links.co2_local_steps)."""
    fp = footprint(m, hw, shape, policy, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                   gpus_per_node=gpus_per_node, doc_mask=doc_mask, doc_work=doc_work, acts=acts,
                   transient=transient, expert_skew=expert_skew, model_states=model_states, co2_steps=co2_steps,
                   settings=settings)
    return timed(m, hw, fp, seq_len=seq_len, global_batch=global_batch, gpus_per_node=gpus_per_node,
                 expert_skew=expert_skew)


def timed(m: ModelConfig, hw: Hardware, fp: Footprint, *, seq_len: int, global_batch: int, gpus_per_node: int = 8,
          expert_skew: float = 1.0) -> Estimate:
    """`estimate`'s second half: bytes per mesh dim, exposed communication, the step, tokens/s, MFU."""
    shape, policy, grad_accum, flops, acts = fp.mesh_shape, fp.policy, fp.grad_accum, fp.flops, fp.acts
    e, tokens, micro_batch, compute = hw.dtype_bytes, fp.tokens, fp.micro_batch, fp.compute
    ranks_per_node = min(gpus_per_node, shape.world)
    calls = attention_call_bytes(m, seq_len, micro_batch, shape, e)
    skew = planned_skew(m, shape, expert_skew)
    comm = comm_bytes_per_step(m, shape, policy, *calls, grad_accum, e, tokens, skew)
    exposed = exposed_per_micro_batch(m, shape, policy, calls, flops, acts, fp.attn_traffic, hw, gpus_per_node)
    exposed.update(exposed_expert_parts(m, hw, shape, comm, grad_accum, tokens, skew, gpus_per_node))
    block_fwd = predicted_block_forward_seconds(flops, m, hw)
    fsdp_step = exposed_fsdp_seconds(m, shape, policy, grad_accum, e, block_fwd, acts.recompute_flops, hw,
                                     gpus_per_node)
    per_step = ({} if fp.model_states == "device" else exposed_host_state_seconds(
        m, shape, fp.model_states, hw, grad_accum, block_fwd * m.layers, compute - block_fwd * m.layers,
        ranks_per_node, policy.grad_sync))
    if shape.data_parallel == "co2":
        per_step["co2_outer"] = fp.co2_outer
    times = step_times(compute, exposed, fsdp_step, grad_accum, per_step)
    tps = global_batch * seq_len / times["step"] if times["step"] > 0 else float("inf")
    mfu = tps * model_flops_per_token(m, seq_len) / (shape.world * hw.peak_flops)
    neck = bottleneck(compute, exposed, fsdp_step, grad_accum, policy, flops, acts, per_step)
    return Estimate(shape, policy, micro_batch, grad_accum, seq_len, global_batch, fp.memory, fp.host_per_node,
                    comm, times, tps, mfu, neck, fp.feasible, fp.problems, fp.work, fp.model_states, fp.host)
