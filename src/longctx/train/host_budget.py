"""Host memory as a budget: a run whose ranks on this node would not fit in the free host memory is
refused before any work (issue 49), not ended by the OOM killer in its first step.

One rank's host bytes come from costs/host_bytes.py `predicted_rank_bytes`, the figure the planner
plans with: the model-state tier's host states, offloaded activations and attention state, DCP's
staging under checkpoint.async, the data loader's batches. On a CPU run the device is host memory
too, so the rank's device bytes (states, FSDP's gathers, activations, transient) are counted as
well, as one memory holds them (costs/host_bytes.py one_memory_bytes: under `host` the gradients and
the saved activations never meet; the foreach AdamW's step under `device`). The largest stage of
train.stages still to run sets the figure (a resumed run's: stages_left). `memory.offload_fraction = auto` is
decided inside the ranks (memory/auto.py), bounded by 0.8 x this rank's share of host memory less the rank's
other host bytes (the model-state tier's states, staging, the loader): it is counted here at its largest,
fraction 1.0, capped at that bound. On a CUDA run each rank's CUDA context and the libraries it loads (the CUDA runtime,
cuBLAS, cuDNN, NCCL) take host memory too: costs/cuda_runtime.py's one figure, part "cuda_runtime", which the
planner's host/node counts the same way. Ranks yet to start (`longctx train --nproc N`) each take an interpreter
with torch and longctx imported, part "process" (this launcher's RSS, at most costs/rank_process.py's figure, which
the planner's host/node counts for every rank): the plan and the preflight count the same parts.

The budget is MemAvailable, or what this process's memory cgroup leaves where that is less (a container's
limit: memory/auto.py `host_memory_free`), or LONGCTX_HOST_MEMORY_BYTES
(bytes, a testing aid like LONGCTX_FAULT: docs/running.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch
from torch import nn

from .. import env_vars
from ..config import Config, ModelConfig
from ..config.checkpoint_paths import manifest_or_empty, resume_candidates
from ..config.resume import checkpoint_root, resumed_manifest
from ..costs.cuda_runtime import CUDA_RUNTIME, CUDA_RUNTIME_BYTES, with_cuda_runtime
from ..costs.host_bytes import (
    one_memory_bytes,
    pinned_fp32_shard_bytes,
    predicted_rank_bytes,
    rank_params,
    stager_registers,
)
from ..costs.rank_process import PROCESS, PROCESS_BYTES, with_process
from ..costs.shape import MeshShape
from ..errors import ConfigError
from ..job.checks import node_size, zero_pp_names
from ..job.devices import computes_in_bf16
from ..memory.auto import host_memory_free
from ..memory.peak_routing import from_step
from ..memory.policy import MemoryPolicy
from ..memory.rss import current_rss_bytes
from ..models.clover import CloverDraft
from ..models.glide import GlideDraft
from ..ops.pinned import pinned_bytes, pins, planned_pinned_bytes
from .stages import Stage, stages_of

BUDGET_ENV = env_vars.HOST_MEMORY_ENV
AUTO_SHARE = 0.8  # memory/auto.py: offload_fraction auto keeps within 0.8 x host memory per rank
CPU_DEVICE = "device (CPU: host memory)"
GIB = 2**30

# what to change when a part is the largest
ADVICE = {
    "model_states": "memory.model_states=device (the host tiers keep 16 bytes per parameter in host memory), "
                    "or more ranks sharding the states over more nodes",
    "activations": "a lower memory.offload_fraction or a higher memory.offload_skip_last",
    "attention_offload": "memory.attention_offload=false",
    "checkpoint_staging": "checkpoint.async=false (async saves keep a host copy of the states)",
    "co2_checkpoint": "train.data_parallel=sync, or more ranks per replica (a co2 save copies each rank's own "
                      "CO2 state to host memory)",
    "data_loader": "a shorter train.seq_len or a smaller train.global_batch",
    CPU_DEVICE: "a smaller model, a shorter train.seq_len, or memory.recompute=full with memory.block_chunk",
    PROCESS: "fewer ranks (--nproc): each is an interpreter with torch before any of the run's bytes",
    CUDA_RUNTIME: f"fewer ranks per node (--nproc), or a node with more free host memory: each CUDA rank holds its "
                  f"CUDA context and libraries (the CUDA runtime, cuBLAS, cuDNN, NCCL; "
                  f"~{CUDA_RUNTIME_BYTES / GIB:.2f} GiB: costs/cuda_runtime.py) besides the run's bytes",
}
PER_PROCESS = (PROCESS, CUDA_RUNTIME)  # parts whose advice is already fewer ranks


def host_budget() -> tuple[float, str]:
    """(bytes of host memory this node's ranks may use, where the figure comes from)."""
    value = env_vars.host_memory_bytes()  # (a number of bytes >= 0, or None: env_vars.py)
    if value is None:
        free, source = host_memory_free()
        return float(free), source
    return value, f"the budget {BUDGET_ENV}={os.environ[BUDGET_ENV].strip()}"


def run_shape(cfg: Config, dims) -> MeshShape:
    """The run's layout as the cost formulas take it: its degrees, and how its FSDP transfers cross nodes
    (parallel.zero_pp's hpz copy over a node's or hpz_ranks' ranks) and its replicas agree (co2's outer state)."""
    names = zero_pp_names(cfg)
    return MeshShape(dims.dp_replicate, dims.dp_shard, dims.head, dims.ctx, dims.window, dims.placement, dims.expert,
                     zero_pp=",".join(names), node=node_size(cfg, dims) or 0, hpz_ranks=cfg.parallel.hpz_ranks,
                     data_parallel=cfg.train.data_parallel, local_steps=cfg.train.co2_local_steps,
                     quant_block=cfg.parallel.zero_pp_block,
                     expert_replicas=cfg.parallel.expert_replicas if dims.expert > 1 else 0,
                     expert_ranks_per_node=cfg.parallel.expert_ranks_per_node if dims.expert > 1 else 0)


def _stage_bytes(cfg: Config, dims, device_type: str, seq_len: int, global_batch: int, memory,
                 offload_cap: float = math.inf, model: ModelConfig | None = None,
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(device bytes, host bytes) of one rank in one stage shape, under the [memory] settings `memory`; `model`:
    counted_model(cfg), given where a caller counts several shapes (it reads the resume's manifests)."""
    shape = run_shape(cfg, dims)
    fp32 = not computes_in_bf16(cfg.train.dtype, device_type, start_cuda=False)  # (run by the launcher)
    micro_batch = max(1, global_batch // cfg.train.grad_accum // shape.dp)
    device, host = predicted_rank_bytes(
        model or counted_model(cfg), shape, MemoryPolicy.from_config(memory), cfg.memory.model_states, seq_len=seq_len,
        micro_batch=micro_batch, grad_accum=cfg.train.grad_accum, dtype_bytes=4 if fp32 else 2,
        doc_mask=cfg.data.doc_mask, async_checkpoint=cfg.checkpoint.async_save, offload_cap=offload_cap,
        bucket_blocks=max(1, cfg.parallel.grad_bucket_blocks), co2_momentum=cfg.train.co2_outer_momentum > 0,
        device_type=device_type)
    if not cfg.checkpoint.saves_or_resumes:  # (a run that can never save takes no copy: not even on a signal)
        host = {**host, "co2_checkpoint": 0.0}
    if cfg.draft.target:
        states, host_parts = draft_states(cfg, shape, pins(device_type))
        device = {**device, "model_states": states}
        device["total"] = sum(v for k, v in device.items() if k != "total")
        host = {**host, **host_parts}
    host["total"] = sum(v for k, v in host.items() if k != "total")
    return device, host


def counted_model(cfg: Config) -> ModelConfig:
    """cfg.model as the steps this run has left count it (memory/peak_routing.py from_step, at resume_step): a
    DTS-Gate run resumed into or past its schedule is counted at the widest step it still runs, not at step 0's E
    experts per token."""
    return from_step(cfg.model, resume_step(cfg))


def stages_left(cfg: Config, step: int | None = None) -> list[Stage]:
    """The train.stages stages whose steps are still to run from resume_step (the last stage where none is): what
    the host budget and memory.offload_fraction auto (train/model.py) count. A resume past a longer stage is not
    counted at it, an over-count that refused a run or chose more offload than it needs."""
    step, stages = resume_step(cfg) if step is None else step, stages_of(cfg)
    return [s for s in stages if s.last_step > step] or stages[-1:]


def resume_step(cfg: Config) -> int:
    """The step of the checkpoint this run resumes from (0: from the start), the first step left to run being the
    one after it. The checkpoint is the one checkpoint.resume loads (config/resume.py resumed_manifest; none: 0);
    under `auto` the oldest it may load (resume_candidates whose manifests read): it passes over one whose files
    are damaged, which only their checksums tell as it loads, for the one before it (checkpoint/manager.py
    resume_point), whose next steps route more (counted at the newest, a fallback from step 4 to step 2 ran 5
    experts per token counted at 2) and may lie in an earlier stage. A resume past a rollback starts later still,
    whose steps route no more and are in no earlier stage. `auto` without train.run_dir or checkpoint.dir: a new
    run directory, none to resume (not ./checkpoints)."""
    if cfg.checkpoint.resume != "auto":
        return _step(resumed_manifest(cfg, Path(cfg.train.run_dir)))
    if not cfg.train.run_dir and not cfg.checkpoint.dir:
        return 0
    candidates = resume_candidates(checkpoint_root(cfg, Path(cfg.train.run_dir)))
    return min((_step(m) for p in candidates if (m := manifest_or_empty(p))), default=0)


def _step(manifest: dict) -> int:
    """A manifest's step; 0 (counted from the start) where it records none that is a number: an older candidate's
    garbled manifest, which the load passes over, is no reason to fail here."""
    step = manifest.get("step")
    return step if isinstance(step, int) else 0


def draft_states(cfg: Config, shape: MeshShape, pinned: bool) -> tuple[float, dict[str, float]]:
    """Under draft training (draft.target) one rank's (device model states, {"model_states", "checkpoint_staging"}
    in host memory). The run's model config is the frozen target's, but the optimizer and a save hold the
    draft's parameters alone (train/glide.py): the tier's states are the draft's (16 bytes per parameter of
    its shard, pinned as costs/host_bytes.py pins the model's; 12 staged), beside the target's fp32 weights,
    frozen: on the device, or under memory.model_states = host in host memory (frozen_target parallelises
    it under the run's tier: FSDP2's CPU offload, no gradients or moments)."""
    d, tier = cfg.draft, cfg.memory.model_states
    with torch.device("meta"):
        draft = CloverDraft(cfg.model, d.vocab) if d.kind == "clover" else GlideDraft(cfg.model, d.layers, d.vocab)
    group = shape.fsdp if shape.world > 1 else 1  # (FSDP shards dim 0 of each draft layer and of its root)
    numels = [math.prod([-(-p.shape[0] // group), *p.shape[1:]]) if p.dim() else 1 for p in draft.parameters()]
    n, sizes = sum(numels), [4 * k for k in numels]
    target = pinned_fp32_shard_bytes(cfg.model, shape) if pinned else 4.0 * rank_params(cfg.model, shape)
    if tier == "device":
        return 16.0 * n + 4.0 * rank_params(cfg.model, shape), {"model_states": 0.0, "checkpoint_staging": 0.0}
    if not pinned:
        states = 16.0 * n
    elif tier == "host_optimizer":  # masters and gradient buffers carved out of slabs (ops/pinned.py)
        states = planned_pinned_bytes(sizes * 2) + 8.0 * n
    else:  # weight shards and gradient copies pinned one by one by FSDP2
        states = 2 * sum(pinned_bytes(s) for s in sizes) + 8.0 * n
    staging = 0.0
    if cfg.checkpoint.async_save:
        staging = 12.0 * n if not pinned or stager_registers() else 3.0 * sum(pinned_bytes(s) for s in sizes)
    if tier == "host":
        return 0.0, {"model_states": states + target, "checkpoint_staging": staging}
    # host_optimizer: the draft's weights, and its gradients until the host takes them (at world 1 a layer's
    # as its backward ends, as costs/host_bytes.py device_state_bytes counts the model's; under FSDP the shards')
    layer = max(sum(p.numel() for p in m.parameters()) for m in draft.modules()
                if m is not draft and not isinstance(m, nn.ModuleList))
    grads = 4.0 * (layer if shape.world == 1 else n)
    return 4.0 * n + grads + 4.0 * rank_params(cfg.model, shape), {"model_states": states,
                                                                    "checkpoint_staging": staging}


def host_bytes_besides_offload(cfg: Config, dims, device_type: str, seq_len: int, global_batch: int,
                               model: ModelConfig | None = None) -> float:
    """One rank's host bytes other than its offloaded activations (the model-state tier's states, the
    attention core's per-chunk extras, checkpoint staging, the data loader) in one stage shape: what
    memory.offload_fraction = auto's share of host memory must hold besides the activations it offloads."""
    _, host = _stage_bytes(cfg, dims, device_type, seq_len, global_batch,
                           dataclasses.replace(cfg.memory, offload_fraction=0.0), model=model)
    return host["total"] - host["activations"]


def rank_host_bytes(cfg: Config, dims, device_type: str, ranks_on_node: int, budget: float,
                    cuda_context_held: bool = False) -> dict[str, float]:
    """One rank's host bytes by part and their "total", for the stage still to run that needs the most. Under
    offload_fraction auto the activations are counted at fraction 1.0, capped at what auto may take: 0.8 x
    this rank's share of the budget, less the rank's other host bytes (memory/auto.py). On a CUDA run, the
    rank's CUDA context and libraries ("cuda_runtime": costs/cuda_runtime.py) too, unless `cuda_context_held`
    (the rank is this process, CUDA started in it before the check: the free memory holds them already)."""
    auto = cfg.memory.offload_fraction == "auto"
    memory = dataclasses.replace(cfg.memory, offload_fraction=1.0) if auto else cfg.memory
    worst: dict[str, float] = {"total": -1.0}
    step = resume_step(cfg)  # (once: it reads the resume's manifests)
    model = from_step(cfg.model, step)
    for stage in stages_left(cfg, step):
        cap = math.inf
        if auto:
            besides = host_bytes_besides_offload(cfg, dims, device_type, stage.seq_len, stage.global_batch, model)
            cap = max(0.0, AUTO_SHARE * budget / max(1, ranks_on_node) - besides)
        device, host = _stage_bytes(cfg, dims, device_type, stage.seq_len, stage.global_batch, memory, cap, model)
        parts = {k: v for k, v in host.items() if k != "total"}
        if device_type == "cpu":
            parts[CPU_DEVICE] = one_memory_bytes(cfg.model, run_shape(cfg, dims), cfg.memory.model_states, device,
                                                 host, cfg.train.grad_accum) - host["total"]
        parts["total"] = sum(parts.values())
        if parts["total"] > worst["total"]:
            worst = parts
    return with_cuda_runtime(worst) if device_type == "cuda" and not cuda_context_held else worst


def check_host_memory(cfg: Config, dims, ranks_on_node: int, device_type: str, new_processes: bool = False) -> None:
    """Raise a ConfigError when this node's ranks would need more host memory than the budget. `new_processes`: the
    ranks are processes yet to start (`longctx train --nproc N`'s launcher), each of which takes an interpreter with
    torch and longctx imported before any of the run's bytes ("process": this launcher's own size stands for it, at
    most costs/rank_process.py's PROCESS_BYTES, the figure the planner counts), which the free memory does not yet
    hold; a rank that runs already (a torchrun rank, one in-process run) holds
    its own. On a CUDA run each rank's CUDA context and libraries ("cuda_runtime", ~1 GiB: costs/cuda_runtime.py)
    are counted where the free memory does not hold them yet: ranks to start, and this process as the rank (the
    launcher's --nproc 1, train/trainer.py train's in-process run) until it has made its context
    (`cuda_context_made`; the launcher makes none: job/devices.py native_bf16). Where it has, the context is in
    the free memory already (libraries it loads later, cuBLAS at the first matmul, are then not counted)."""
    budget, source = host_budget()
    held = not new_processes and cuda_context_made()
    per_rank = rank_host_bytes(cfg, dims, device_type, ranks_on_node, budget, cuda_context_held=held)
    if new_processes:
        # (at most PROCESS_BYTES, the planner's figure: a launcher holding more than its imports, a notebook's or a
        # test worker's, is no rank's start)
        per_rank = with_process(per_rank, min(current_rss_bytes(), PROCESS_BYTES))
    need = per_rank["total"] * ranks_on_node
    if need <= budget:
        return
    parts = {k: v * ranks_on_node for k, v in per_rank.items() if k != "total" and v > 0}
    listed = ", ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    largest = max(parts, key=parts.get)
    ranks = f"{ranks_on_node} ranks x {_size(per_rank['total'])}" if ranks_on_node > 1 else "1 rank"
    fixes = [ADVICE[largest]] + (["fewer ranks on this node (--nproc)"] if ranks_on_node > 1 and
                                 largest not in PER_PROCESS else [])
    auto = (" (memory.offload_fraction auto counted at 1.0, capped at 0.8 x each rank's share of the budget less "
            "its other host bytes)"
            if cfg.memory.offload_fraction == "auto" else "")
    raise ConfigError(
        f"this run needs {_size(need)} of host memory on this node ({ranks}; memory.model_states="
        f"{cfg.memory.model_states}: {listed}){auto}, but {source} is {_size(budget)}. It would be killed by the "
        f"OOM killer, so it is refused before any work. To fit, try: {'; or '.join(fixes)}.")


def cuda_context_made() -> bool:
    """Whether this process holds its CUDA context already. Asks, starts nothing: torch.cuda initialised (which
    train.compile's Triton check does, asking the card's properties, with no context made) and the current
    device's primary context made (a build without that query: initialised is taken as made)."""
    if not torch.cuda.is_initialized():
        return False
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return has_context is None or bool(has_context(torch.cuda.current_device()))


def _size(nbytes: float) -> str:
    """'12.3 GiB (13,207,024,435 bytes)': readable, and exact for a test's budget."""
    return f"{nbytes / GIB:.2f} GiB ({nbytes:,.0f} bytes)"
