"""The training model: memory.offload_fraction = auto measured and decided into a new config, then
the model built by the builder of its kind (MODEL_BUILDERS: dense, MoE, GliDe draft): on the meta
device, parallelised (parallel/parallelize.py) and only then materialised, each rank filling its
own shards from the seed or the starting weights (weights.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import Config, build_model_config
from ..config.hf import init_from_notes
from ..config.positions import model_reach
from ..job.checks import launcher_node_ranks
from ..job.devices import resolve_dtype
from ..job.runtime import Runtime
from ..memory import auto  # (module attributes, so tests can stand in for the machine's measurements)
from ..memory.accounting import activation_dtype
from ..memory.peak_routing import from_step
from ..memory.policy import MemoryPolicy
from ..models.llama import Block, Llama, build_model, rope_cos_sin, rope_inv_freq
from ..ops.pinned import pins
from ..parallel.fsdp.shard import materialize
from ..parallel.parallelize import parallelize, sequence_parallel_core
from .glide import build_glide_training
from .host_budget import counted_model, host_bytes_besides_offload, resume_step, stages_left
from .weights import load_weights


def resolve_offload(cfg: Config, device: torch.device, rt: Runtime, log=print) -> Config:
    """The config with memory.offload_fraction = auto measured and decided (a new config; the one
    given is not changed); the config itself when the fraction is a number already."""
    if cfg.memory.offload_fraction != "auto":
        return cfg
    fraction = auto_offload_fraction(cfg, device, rt, log)
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, offload_fraction=fraction))


def model_kind(cfg: Config) -> str:
    """What a run trains: `glide` (a GliDe draft against the frozen draft.target), else `moe` (a model
    with routed experts: routers to train, moe_hooks.py) or `dense`."""
    if cfg.draft.target:
        return "glide"
    return "moe" if cfg.model.is_moe else "dense"


def build_llama_training(cfg: Config, device: torch.device, rt: Runtime, log=print) -> Llama:
    """A dense or MoE decoder (models/llama.py builds either; parallelize applies expert parallelism),
    built on the meta device, parallelised, and only then materialised: each rank allocates and
    fills just its own shards, from the seed (the same values one process draws, so every layout
    starts identical) or from the starting weights (each rank reading only its rows)."""
    model = build_model(cfg.model, device="meta")
    model = parallelize(model, rt.dims, cfg, rt.mesh, device.type)
    materialize(model, cfg, device)
    source = cfg.model.init_from
    if not source:
        model.init_weights(cfg.train.seed)
        return model
    path = load_weights(model, source, rt, log)
    changed = init_from_changes(cfg)
    log(f"weights: read from {path}" +
        (f"; changed for this run: {', '.join(changed)}" if changed else "") +
        "".join(f"; {note}" for note in idle_scaling_notes(cfg.model) + init_from_notes(source)))
    return model


# model_kind -> the builder of the model the Trainer optimises: (cfg, device, rt, log) -> nn.Module
MODEL_BUILDERS = {
    "dense": build_llama_training,
    "moe": build_llama_training,
    "glide": build_glide_training,  # the draft + its frozen target (glide.py)
}


def build_training_model(cfg: Config, device: torch.device, rt: Runtime, log=print) -> nn.Module:
    """The model a run trains, by MODEL_BUILDERS[model_kind(cfg)]. No rank ever holds the whole
    model. memory.offload_fraction must be resolved (resolve_offload)."""
    return MODEL_BUILDERS[model_kind(cfg)](cfg, device, rt, log)


def init_from_changes(cfg: Config) -> list[str]:
    """The [model] keys this run sets differently from what its init_from weights describe (their
    config.json or manifest, with defaults for what they leave out): only what really changed."""
    own = vars(build_model_config({"init_from": cfg.model.init_from}))
    changed = [f"model.{k}: {own[k]!r} -> {v!r}" for k, v in vars(cfg.model).items() if own[k] != v]
    m = cfg.model
    if m.rope_scaling in ("yarn", "llama3") and any(own[k] != getattr(m, k) for k in ("rope_scaling", "rope_factor")) \
            and own["rope_original_max_len"] == m.rope_original_max_len:  # (the length it stretches, even a default)
        changed.append(f"model.rope_original_max_len: {m.rope_original_max_len!r} (unchanged)")
    return changed


def idle_scaling_notes(m) -> list[str]:
    """A yarn / llama3 scaling added at init_from whose original length lies past what the weights learned
    unscaled stretches none of it (config/positions.py idle_original; generate refuses such a model's longer
    prompts): said before training on it, with the flag that extends."""
    reach = model_reach(m)
    if not reach.idle_original:
        return []
    return [f"note: model.rope_original_max_len {reach.idle_original:,} is past the {reach.unscaled:,} positions the "
            f"weights learned unscaled ({reach.source}), so the {m.rope_scaling} scaling stretches none of them; set "
            f"--model.rope_original_max_len={reach.unscaled} to extend them"]


def _timing_block(cfg: Config, device: torch.device, rt: Runtime) -> Block:
    """One block with random weights and the run's attention core (2D sequence parallel under a
    layout): what offload_fraction=auto times, before the model is built."""
    with torch.device("meta"):
        block = Block(cfg.model)
    block.to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, cfg.model.init_std) if p.dim() > 1 else p.fill_(1.0)
    core = sequence_parallel_core(rt.dims, rt.mesh)
    if core is not None:
        block.attention.core = core
    return block


def auto_offload_fraction(cfg: Config, device: torch.device, rt: Runtime, log) -> float:
    """memory.offload_fraction = auto: measure (every rank, the slowest counts) and decide. With
    train.stages, each distinct shape of the stages still to run is measured and decided, and the smallest fraction
    holds for the run: one stage may have more tokens per micro-batch (host memory) or a shorter
    block forward to hide the transfers behind (the link) than the last."""
    # the ranks sharing this machine's memory: the launcher's (torchrun sets LOCAL_WORLD_SIZE), else every rank,
    # as the host preflight counts them (job/checks.py ranks_per_node; job/spawn.py starts all on one machine)
    ranks_per_node = launcher_node_ranks(rt.world)
    # the slowest link and the least memory over all ranks decide
    link, host = (-v for v in rt.max([-auto.host_link_bandwidth(device),
                                      -auto.host_memory_available() / ranks_per_node]))
    # (a resumed run's stages still to run: one it has passed holds no step left: host_budget.py stages_left)
    step = resume_step(cfg)  # (once: it reads the resume's manifests)
    shapes = sorted({(s.seq_len, s.global_batch) for s in stages_left(cfg, step)})
    model = from_step(cfg.model, step)
    chosen = [_offload_for_shape(cfg, device, rt, seq_len, global_batch, link, host, model)
              for seq_len, global_batch in shapes]
    fraction, reason = min(chosen, key=lambda c: c[0])
    if len(shapes) > 1:
        each = ", ".join(f"{s} tokens x {b}: {a:.2f}" for (s, b), (a, _) in zip(shapes, chosen))
        reason += f" (the smallest over train.stages' shapes: {each})"
    log(reason)
    return fraction


def _offload_for_shape(cfg: Config, device: torch.device, rt: Runtime, seq_len: int, global_batch: int,
                       link_bytes_per_s: float, host_bytes_per_rank: float, model=None) -> tuple[float, str]:
    """offload_fraction auto's choice in one stage shape; `model`: cfg.model as the run's steps left count it
    (train/host_budget.py counted_model), given by a caller that counts several shapes."""
    d, t, model = rt.dims, cfg.train, model or counted_model(cfg)
    local_batch, local_seq = global_batch // (t.grad_accum * rt.dp), seq_len // (d.head * d.ctx)
    x = torch.randn(local_batch, local_seq, cfg.model.dim, device=device)
    positions = torch.arange(local_seq, device=device).expand(local_batch, local_seq)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.model, device=device))
    bf16 = resolve_dtype(t.dtype, device) == torch.bfloat16
    # (one process off the host tier in bf16: autocast over fp32 weights, its block inputs fp32, the matmuls'
    # outputs bf16: each offloaded tensor counted at its dtype)
    act_bytes, autocast = activation_dtype(bf16, rt.dims.world_size, cfg.memory.model_states, device.type)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        block_s = auto.measured_block_forward_seconds(_timing_block(cfg, device, rt), x, cos, sin, None)
    block_s = rt.max([block_s])[0]  # the slowest block decides
    return auto.choose_offload_fraction(
        model, seq_len, local_batch, head=d.head, ctx=d.ctx, skip_last=cfg.memory.offload_skip_last,
        dtype_bytes=act_bytes, autocast=autocast,
        block_seconds=block_s, link_bytes_per_s=link_bytes_per_s,
        host_bytes_per_rank=host_bytes_per_rank, expert=d.expert,
        expert_replicas=cfg.parallel.expert_replicas if d.expert > 1 else 0,
        expert_ranks_per_node=cfg.parallel.expert_ranks_per_node if d.expert > 1 else 0,
        # (the model-state tier's states, staging and the loader share the rank's host memory with the offload)
        host_bytes_taken=host_bytes_besides_offload(cfg, rt.dims, device.type, seq_len, global_batch, model),
        # (the run's other [memory] settings put bytes on the host too: attention_offload's core state)
        policy=MemoryPolicy.from_config(dataclasses.replace(cfg.memory, offload_fraction=0.0)),
        pinned=pins(device))
