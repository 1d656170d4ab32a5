"""parallelize(model, dims, cfg, mesh): turn the single-device model into the hybrid-parallel one.

The order is fixed and matters:
  1. distributed attention in every layer: each block's attention kernel (`Attention.core`, the
     model's single hook) becomes 2D sequence-parallel attention over the head x ctx ranks;
  2. activation memory policy (memory/apply_policy.py): wraps block forwards, so it must see the
     blocks before FSDP wraps them and must wrap the distributed attention already in place;
     the chunked LM head + loss (ops/loss.py) is switched on here too;
  3. with train.compile, each block's token-wise parts are compiled (models/compile.py);
  4. FSDP2 `fully_shard` on every block (under expert parallelism, its experts first, over their own
     expert-data group: parallel/expert/install.py), then on the root (embeddings, final norm, LM head), over
     the data x head x context ranks flattened into one shard dim (LoongTrain's hybrid ZeRO: the
     sequence ranks share the model states too), with dp_replicate as the HSDP replica dim.

FSDP AVERAGES gradients over all ranks (shard and replica dims: the world). The training loop
divides each rank's summed loss by the number of valid tokens of the global batch and multiplies
it by `grad_scale(dims)` = the world size, so the average is the exact global mean. (A divide
factor of 1 would say the same more directly, but FSDP implements it with PREMUL_SUM, which gloo
lacks.)
On GPU, parameters are gathered in bf16 and gradients reduced in fp32; on CPU everything is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from ..job import comm
from ..memory.apply_policy import apply_glide_memory_policy, apply_memory_policy
from ..models.compile import compile_token_wise_parts
from ..models.llama import local_attention
from ..models.moe import MoEFeedForward, moe_layers
from ..ops.chunked import ChunkedLocalCore
from .context.attention import SequenceParallelCore
from .context.sequence import gather_shards
from .expert.call_tokens import MicroBatchTokens
from .expert.install import use_expert_parallel
from .fsdp.shard import fsdp_mesh, mixed_precision, shard_model, states_offload, uses_fsdp


def sequence_parallel_core(dims, mesh):
    """The attention kernel of 2D sequence parallelism over the head x ctx ranks (None when both
    degrees are 1: the single-device kernel stays)."""
    return SequenceParallelCore(mesh, dims.window) if dims.sequence_degree > 1 else None


def use_sequence_parallel_attention(model, dims, mesh) -> None:
    """Swap every block's attention kernel for 2D sequence-parallel attention (when any degree > 1)."""
    core = sequence_parallel_core(dims, mesh)
    if core is not None:
        for block in model.layers:
            block.attention.core = core
        model.split_sequence = True  # (a forward without positions is refused: models/llama.py)


def use_router_sum(model, dims, mesh) -> None:
    """MoE: the balancing losses read statistics over every token of the micro-batch, and each rank
    holds a share of them (its data-parallel rows, its part of each sequence): the model sums its
    router statistics over all ranks, so that no layout changes the loss (models/moe.py). The routing
    decisions that look across tokens (a capacity, the Sinkhorn router) are made over the same ranks'
    tokens, in one-device order: every MoE layer's `call_tokens` (parallel/expert/call_tokens.py)."""
    if dims.world_size > 1 and model.cfg.is_moe:
        ranks = comm.flattened(mesh["dp_replicate", "dp_shard", "head", "ctx"], "router")
        model.router_sum = RouterSum(ranks)
        tokens = MicroBatchTokens(mesh, ranks)
        tokens.watch([block for block in model.layers if moe_layers(block)])
        for layer in moe_layers(model):
            layer.call_tokens = tokens


@dataclass(frozen=True)
class RouterSum:
    """The model's `router_sum` under data or sequence parallelism: a tensor of router statistics
    summed over every rank of `mesh` (the world, flattened)."""
    mesh: object

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(t, mesh=self.mesh, op=dist.ReduceOp.SUM, label="router")


@dataclass(frozen=True)
class ShardGather:
    """A GliDe draft's `kv_gather` under head x ctx: every rank's sequence shard of a tensor over
    `mesh`, concatenated (context/sequence.py gather_shards)."""
    mesh: object
    label: str

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        return gather_shards(local, self.mesh, label=self.label)


def use_attention_chunks(model, chunk: int, offload: bool) -> None:
    """Run every block's attention core in chunks of `chunk` tokens (ops/chunked.py): the
    single-device core, or each ring block of the sequence-parallel one; `offload` keeps the core's
    saved state in host memory until backward."""
    if not chunk:
        return
    for block in model.layers:
        block.attention.core = chunked_core(block.attention.core, chunk, offload)


def chunked_core(core, chunk: int, offload: bool):
    """An attention core (the single-device one, or 2D sequence parallel) run in chunks of `chunk` tokens."""
    if isinstance(core, SequenceParallelCore):
        return core.chunked(chunk, offload)
    if core is local_attention:
        return ChunkedLocalCore(chunk, offload)
    raise ValueError(f"memory.attention_chunk does not know the attention core {core!r}")


def apply_memory(model, memory_cfg, device_type: str) -> None:
    """The attention chunks, the activation policy and the loss chunking; the host offloader (if
    any) is kept on the model as `memory_offloader` (accounting reads it)."""
    fraction = memory_cfg.offload_fraction
    if fraction == "auto":
        raise ValueError("resolve memory.offload_fraction='auto' (memory/auto.py) before apply_memory()")
    use_attention_chunks(model, memory_cfg.attention_chunk, memory_cfg.attention_offload)
    model.memory_offloader = apply_memory_policy(model.layers, memory_cfg.recompute, fraction,
                                                 memory_cfg.offload_skip_last, device_type,
                                                 block_chunk=memory_cfg.block_chunk)
    model.loss_chunk = memory_cfg.loss_chunk
    for layer in model.layers:
        if isinstance(layer.feed_forward, MoEFeedForward):
            layer.feed_forward.experts.chunk = memory_cfg.expert_chunk


def parallelize(model, dims, cfg, mesh, device_type: str = "cpu"):
    """The model, parallelised in place (and returned). memory.offload_fraction must be a number:
    `auto` is resolved before (train/setup.py resolve_offload), into a new config."""
    # 1. distributed attention; MoE router statistics summed over the ranks of the micro-batch
    use_sequence_parallel_attention(model, dims, mesh)
    use_router_sum(model, dims, mesh)
    if dims.expert > 1:  # experts split over expert groups; every MoE layer's dispatcher: ONE object from
        # parallel.expert_* (flat / hierarchical, pipelined chunks, FlexMoE copies: parallel/expert/install.py)
        use_expert_parallel(model, dims.build_expert_mesh(device_type), cfg.parallel.expert_pipeline_chunks,
                            cfg.parallel.expert_replicas, cfg.parallel.expert_placement_window,
                            cfg.parallel.expert_ranks_per_node)
    # 2. activation memory
    apply_memory(model, cfg.memory, device_type)
    # 3. regional compilation of the token-wise parts (the memory policies call them; see models/compile.py)
    if cfg.train.compile:  # (check_compiler ran before: train/preflight.py, the Trainer's and eval's set-up)
        compile_token_wise_parts(model.layers)
    # 4. hybrid ZeRO, the blocks in gradient buckets (at world 1 too when the states live in host memory)
    if uses_fsdp(dims, cfg):
        shard_model(model, dims, cfg, device_type)
    return model


def parallelize_draft(model, dims, cfg, mesh, device_type: str = "cpu"):
    """A GliDe draft's training model (train/glide.py GlideTraining, whose frozen target is
    parallelised apart, by `parallelize`), in the same order as parallelize:
      1. the draft layers' self-attention becomes 2D sequence-parallel attention like the target's,
         and under head x ctx the model all-gathers the target's captured K/V (with their positions
         and document ids) over the head x ctx ranks for the cross-attention (`kv_gather`);
      2. attention chunks, the draft layers' recompute policy (memory/apply_policy.py
         apply_glide_memory_policy), the loss chunking;
      3. FSDP2 on every draft layer, then on the root (the draft's final norm), over the same ranks
         as the target's; the target is not a submodule, so it is neither optimised nor saved."""
    core = sequence_parallel_core(dims, mesh)
    if core is not None:
        for layer in model.draft.layers:
            layer.self_attention.core = core
        model.kv_gather = ShardGather(mesh, "glide_kv")
    mem = cfg.memory
    if mem.attention_chunk:
        for layer in model.draft.layers:
            layer.self_attention.core = chunked_core(layer.self_attention.core, mem.attention_chunk, False)
    apply_glide_memory_policy(model.draft.layers, mem.recompute)
    model.loss_chunk = mem.loss_chunk
    if uses_fsdp(dims, cfg):
        shard_mesh, mp = fsdp_mesh(dims, device_type), mixed_precision(device_type, cfg.train.dtype)
        offload = states_offload(cfg, device_type)
        for layer in model.draft.layers:
            fully_shard(layer, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
    return model
