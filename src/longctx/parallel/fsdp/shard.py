"""FSDP2 (hybrid ZeRO / HSDP) over the model: which ranks shard the states (`fsdp_mesh`), the blocks in
units by the gradient-bucket plan (`shard_model`, grad_buckets.py), the experts in units of their own
over the expert-data group, mixed precision (bf16 gathers on GPU), where the states live
(memory.model_states: `states_offload`, FSDP2's CPU offload), and the loss scale that turns FSDP's
gradient average into the global sum (`grad_scale`). parallel/parallelize.py calls it last, after
context and expert parallelism and the memory policies have changed the blocks."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard

from ...costs.model_states import expert_shard_dim, shard_dim
from ...errors import ConfigError
from ...job.checks import hpz_group, node_size, zero_pp_names
from ...job.comm import link_hook, mesh_with_backstop, sub_mesh
from ...job.devices import computes_in_bf16
from ...models.moe import MoEFeedForward
from .grad_buckets import plan_for, time_reduce_scatters
from .quantized import (
    CountedAllGather,
    CountedReduceScatter,
    QuantizedAllGather,
    QuantizedReduceScatter,
    use_compiled,
    warm_up,
)


def fsdp_mesh(dims, device_type: str):
    """The mesh FSDP2 runs over: (dp_replicate, fsdp), fsdp = the dp_shard x head x ctx ranks.

    Built as its own mesh over CONTIGUOUS ranks rather than by flattening the 4-D mesh: with
    head-first placement the flattened order is permuted (e.g. 0, 2, 1, 3), and Distributed
    Checkpoint then loads shards at offsets that disagree with FSDP's (found by the reshard tests).
    Both placements keep dp_replicate outermost, so replica r is exactly ranks r*n .. r*n+n-1 and the
    groups are the same sets of ranks either way.
    """
    grid = torch.arange(dims.world_size).reshape(dims.dp_replicate, -1)
    if dims.dp_replicate > 1:
        return mesh_with_backstop(DeviceMesh(device_type, grid, mesh_dim_names=("dp_replicate", "fsdp")))
    return mesh_with_backstop(DeviceMesh(device_type, grid[0], mesh_dim_names=("fsdp",)))


def even_placement(group: int):
    """FSDP2's shard_placement_fn over `group` ranks: each parameter on costs' shard_dim (dim 0, or another
    dim the group divides where dim 0 leaves ranks mostly padding: a MoE layer's experts over more ranks
    than experts), so the states per rank the cost model predicts are the ones FSDP keeps."""
    return lambda p: Shard(shard_dim(tuple(p.shape), group))


def expert_placement(group: int):
    """FSDP2's shard_placement_fn for the routed experts under expert parallelism: dim 0 is the expert group's,
    FSDP takes an inner dim the expert-data group of `group` ranks splits evenly (costs' expert_shard_dim)."""
    return lambda p: Shard(expert_shard_dim(tuple(p.shape), group))


# A router's own unit, its gate gathered in fp32 where the blocks gather bf16: the router selects in fp32
# (models/moe.py Router.logits) from the fp32 weights one device routes with; a bf16-rounded gate picked
# another expert set for 0.2-1.4% of tokens (top-2 of 8 to top-8 of 128), so routing depended on the layout.
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def shard_model(model, dims, cfg, device_type: str) -> None:
    """FSDP2 over the blocks, grouped into units by the gradient-bucket plan (parallel/fsdp/grad_buckets.py,
    kept as `model.grad_bucket_plan`), then the root; every unit's reduce-scatter timed
    (`model.grad_reduce_timers`). Under expert parallelism a bucket's expert weights form a unit of
    their own over the expert-data group, sharded on an inner dim (the first is the expert group's).
    Where the blocks gather bf16 (GPU), each MoE layer's router is a unit of its own gathered in fp32."""
    shard_mesh, mp, t = fsdp_mesh(dims, device_type), mixed_precision(device_type, cfg.train.dtype), cfg.train
    if t.data_parallel == "co2":  # each replica an FSDP group of its own: no gradient leaves it (step/co2.py)
        model.co2_replicas, shard_mesh = shard_mesh["dp_replicate"], shard_mesh["fsdp"]
    offload = states_offload(cfg, device_type)
    seq = t.seq_len
    sequences = max(1, t.global_batch // max(t.grad_accum, 1) // (dims.world_size // (dims.head * dims.ctx)))
    tokens = sequences * seq // (dims.head * dims.ctx)  # per rank and micro-batch
    plan = plan_for(cfg.model, cfg.parallel.grad_bucket_blocks, tokens, seq, dims.world_size // dims.dp_replicate,
                    dims.expert, device_type)
    if cfg.memory.model_states == "host" and device_type == "cuda":  # before anything is sharded
        check_staging_fits(model, plan.groups(), gathers_in_bf16(device_type, cfg.train.dtype),
                           torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    expert_mesh = sub_mesh(dims.build_expert_mesh(device_type), "expert_data") if dims.expert > 1 else None
    # parallel.zero_pp = hpz (ZeRO++'s secondary partition): after its forward a block unit stays sharded
    # over the ranks of a node, so its backward all-gather never leaves the node. (The experts' units
    # keep plain resharding: their expert-data group is not node-local in general.)
    reshard = hpz_group(cfg, dims) or True
    # (not under hpz: FSDP2 reshards to the node after forward by cutting the gathered flat buffer, dim 0's layout)
    placement = even_placement(shard_mesh.shape[-1]) if reshard is True else None
    units, expert_units, router_units = [], [], []
    for group in plan.groups():
        blocks = [model.layers[i] for i in group]
        experts = [b.feed_forward.experts for b in blocks
                   if expert_mesh is not None and isinstance(b.feed_forward, MoEFeedForward)]
        if experts:
            expert_units.append(fully_shard(_one_or_list(experts), mesh=expert_mesh, mp_policy=mp,
                                            offload_policy=offload,
                                            shard_placement_fn=expert_placement(expert_mesh.size())))
        if mp.param_dtype is not None:  # routers gather fp32 (below), whatever the blocks gather in
            for router in [b.feed_forward.router for b in blocks if isinstance(b.feed_forward, MoEFeedForward)]:
                router_units.append(fully_shard(router, mesh=shard_mesh, mp_policy=FP32, offload_policy=offload,
                                                reshard_after_forward=reshard, shard_placement_fn=placement))
                # the MoE layer also calls router.logits directly (the sinkhorn assignment, a padding mask, block
                # chunks' first pass): FSDP gathers the gate for that call as for forward. Router.forward reads
                # _logits, never nested in it (the outer post-forward resharded fully: no node copy under hpz)
                register_fsdp_forward_method(router, "logits")
        units.append(fully_shard(_one_or_list(blocks), mesh=shard_mesh, mp_policy=mp, offload_policy=offload,
                                 reshard_after_forward=reshard, shard_placement_fn=placement))
    fully_shard(model, mesh=shard_mesh, mp_policy=root_precision(mp), offload_policy=offload,
                shard_placement_fn=placement)
    # a partition between one rank and the group keeps a node-sharded copy after each forward (reshard_units)
    partial = reshard is not True and 1 < reshard < shard_mesh.shape[-1]
    model.node_sharded_units = [*units, *router_units] if partial else []
    compiled = use_compiled(cfg.parallel.zero_pp_kernels, device_type)
    model.weight_gather = quantize_gathers([*units, model], cfg, dims, compiled, expert_units)
    model.grad_bucket_plan = plan
    model.grad_reduce = quantized_reduce(cfg, dims, device_type, compiled, [*units, model])
    if compiled and {"qwz", "qgz"} & set(zero_pp_names(cfg)):  # a clear error here, not inside the first gather
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else \
            torch.device(device_type)
        gather = torch.bfloat16 if gathers_in_bf16(device_type, cfg.train.dtype) else torch.float32
        warm_up(device, gather, cfg.parallel.zero_pp_block)
    model.grad_reduce_timers = time_reduce_scatters(units, model, inner=model.grad_reduce)


def quantize_gathers(units: list, cfg, dims, compiled: bool = False, expert_units: list = ()
                     ) -> QuantizedAllGather | None:
    """parallel.zero_pp's qwz: every unit's all-gather (forward and backward) in int8 blocks, through one
    QuantizedAllGather that counts the bytes (`compiled`: its kernels, parallel.zero_pp_kernels); None
    without qwz. `units` end with the root; `expert_units` (expert parallelism: over the expert-data
    group) get one of their own that knows no hpz partition (they keep plain resharding, so each of
    their gathers is a whole group's: the shared one took an expert-data group no larger than hpz's
    partition for hpz's exact gather, and left them fp32). A block longer than the smallest
    unit's shard would quantise padding more than weights: refused."""
    if "qwz" not in zero_pp_names(cfg):
        if link_hook() is not None:  # a benchmark's emulated link paces FSDP's gathers too (bench/comm_cluster.py)
            for unit in [*units, *expert_units]:
                (unit[0] if isinstance(unit, list) else unit).set_custom_all_gather(CountedAllGather())
        return None
    block = cfg.parallel.zero_pp_block
    shards = _shards(units[:-1], dims.world_size // dims.dp_replicate)  # (the root, last, holds more)
    if expert_units:  # (global [experts, ...] DTensors, split over the expert group and then the expert-data group:
        shards += _shards(expert_units, dims.world_size)  # 1 / world of them a rank)
    check_block(block, shards)
    # hpz's backward gathers (within its secondary partition) stay exact. A partition as large as the FSDP
    # group is no partition (FSDP2 reshards such a unit fully, so its backward gathers from the shards
    # again): the group itself is then not one to leave exact, or no gather would be quantised (one node,
    # or co2 with a replica per node)
    hpz = hpz_group(cfg, dims) or 0
    comm = QuantizedAllGather(block, node_group=hpz if hpz < dims.world_size // dims.dp_replicate else 0,
                              compiled=compiled)
    for unit in units:
        (unit[0] if isinstance(unit, list) else unit).set_custom_all_gather(comm)
    if expert_units:
        experts = QuantizedAllGather(block, compiled=compiled)
        for unit in expert_units:
            (unit[0] if isinstance(unit, list) else unit).set_custom_all_gather(experts)
    return comm


def quantized_reduce(cfg, dims, device_type: str, compiled: bool = False, units: list = ()
                     ) -> QuantizedReduceScatter | None:
    """parallel.zero_pp's qgz: the gradient reduce-scatter in int8 blocks, within the node first,
    over a mesh (dp_replicate, inter, intra) whose node dims split each FSDP group; None without qgz.
    The experts' units (another group) keep FSDP's own. `units` (ending with the root) bound the block
    as for qwz: each reduce-scatter row is a unit's shard, padded to whole blocks."""
    if "qgz" not in zero_pp_names(cfg):
        return CountedReduceScatter() if link_hook() is not None else None  # (a benchmark's emulated link)
    # checked here, before any work: a block under 1 otherwise fails as a ZeroDivisionError in the byte
    # counts or a reshape error inside the first backward's reduce-scatter, on every rank
    check_block(cfg.parallel.zero_pp_block, _shards(units[:-1], dims.world_size // dims.dp_replicate))
    grid = torch.arange(dims.world_size).reshape(dims.dp_replicate, -1, node_size(cfg, dims))
    mesh = mesh_with_backstop(DeviceMesh(device_type, grid, mesh_dim_names=("dp_replicate", "inter", "intra")))
    return QuantizedReduceScatter(cfg.parallel.zero_pp_block, mesh, compiled=compiled)


def _shards(units, ranks: int) -> list[int]:
    """Each FSDP unit's (a module, or a list of them) elements per rank over `ranks`."""
    return [sum(p.numel() for m in (u if isinstance(u, list) else [u]) for p in m.parameters()) // ranks
            for u in units]


def check_block(block: int, shards: list[int]) -> None:
    """parallel.zero_pp_block (qwz, qgz) against the FSDP units' shards (elements per rank; none known:
    only the lower bound): at least one element, and a block longer than the smallest shard would
    quantise padding more than weights."""
    smallest = min(shards, default=None)
    if block < 1 or (smallest is not None and block > smallest):
        bound = f"1 .. {smallest}" if smallest is not None else "at least 1"
        where = f"the smallest FSDP unit's shard ({smallest:,} elements per rank)" if smallest is not None else \
            "an FSDP unit's shard"
        raise ConfigError(f"parallel.zero_pp_block = {block} elements is not a block of {where}; use "
                          f"{bound} (512 is usual).")


def check_staging_fits(model, groups, bf16: bool, device_bytes: int) -> None:
    """memory.model_states = host keeps the weights in host memory, but FSDP still brings each unit
    whole to the device: the largest unit twice in the gather dtype (this one and the next,
    prefetched), its fp32 gradient before it goes back, and the root (embeddings, final norm, LM
    head) with its gradient. When that staging alone exceeds the device, refuse before sharding."""
    per_block = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    largest = max(sum(per_block[i] for i in group) for group in groups)
    root = sum(p.numel() for p in model.parameters()) - sum(per_block)
    gather = 2 if bf16 else 4
    need = 2 * largest * gather + 4 * largest + root * (gather + 4)
    if need > device_bytes:
        blocks = max(len(group) for group in groups)
        raise ConfigError(
            f"memory.model_states=host stages each FSDP unit on the device: the largest unit ({blocks} block(s), "
            f"{largest / 1e6:,.0f}M parameters) twice in {'bf16' if bf16 else 'fp32'} (this one and the prefetched "
            f"next), its fp32 gradient and the root module ({root / 1e6:,.0f}M: embeddings, LM head) need "
            f"{need / 2**30:.1f} GiB, more than this device's {device_bytes / 2**30:.1f} GiB before any "
            f"activation. Use parallel.grad_bucket_blocks=1 (one block per unit), bf16 gathers (train.dtype=bf16), "
            f"or a smaller model.")


def _one_or_list(modules: list):
    """fully_shard's argument for one unit: a module alone, as it always was, or a list (one group)."""
    return modules[0] if len(modules) == 1 else modules


def reshard_units(model: torch.nn.Module) -> None:
    """Every FSDP unit of `model` back to its sharded parameters after forwards with no backward (an evaluation).
    FSDP2 reshards a unit in its backward; after a forward alone the root keeps its gathered parameters (FSDP2
    never reshards the root after forward, whose backward would gather them again) and, under hpz with a one-rank
    partition (reshard_after_forward False), so does every block. `model.parameters()` then returned those
    plain tensors, not the DTensors the optimizer updates (`full_tensor` failed, a mesh read as None), and
    they held their memory until the next step's backward.

    Under hpz with a larger partition each block unit and each MoE router's own unit (`model.node_sharded_units`,
    shard_model) keeps its node-sharded copy instead, no parameter: FSDP2's reshard() registers the sharded
    parameters but leaves that copy held (FSDPParam.to_sharded frees only the gathered buffers) until the unit's
    next forward replaces it, 1.57 MB a rank (debug model, 4 ranks, nodes of 2). Only a gather FROM that copy frees it
    (FSDPParam.to_unsharded), so such a unit is unsharded first, through FSDP2's public unshard(): an
    all-gather within the partition (the node's link, exact under qwz as the backward's), one unit at a
    time, once per evaluation; then reshard() drops the gathered weights. The values are the copy's, never
    written back: the sharded parameters the next step trains are untouched."""
    for unit in getattr(model, "node_sharded_units", ()):  # (before any reshard: from SHARDED it would gather
        first = unit[0] if isinstance(unit, list) else unit  # the whole group's shards instead)
        first.unshard()
        first.reshard()
    for module in model.modules():
        if isinstance(module, FSDPModule):  # (a grouped unit's second module finds it resharded: a no-op)
            module.reshard()


def uses_fsdp(dims, cfg) -> bool:
    """FSDP2 wraps the model under more than one rank, and at world 1 when memory.model_states puts
    the weights in host memory (`host`: its CPU offload is FSDP's; join_job made the one-rank group).
    `host_optimizer` at world 1 needs no FSDP: the weights stay whole on the device and
    step/host_optimizer.py moves each gradient as autograd finishes it."""
    return dims.world_size > 1 or cfg.memory.model_states == "host"


def states_offload(cfg, device_type: str) -> OffloadPolicy:
    """memory.model_states = host: FSDP2's CPUOffloadPolicy. Each unit's sharded fp32 parameters,
    gradients and (the optimizer being built on them) AdamW moments live in host memory; the unit's
    all-gather brings its parameters to the device for forward and again for backward, and its
    reduce-scatter's gradient shard is copied back to the host. Pinned host memory on CUDA (copies
    that overlap), plain memory on CPU, where host and device are one memory and the copies are none."""
    if cfg.memory.model_states == "host":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def materialize(model: torch.nn.Module, cfg, device: torch.device) -> None:
    """model.to_empty after parallelize. Under memory.model_states = host on an accelerator, FSDP2's CPU
    offload keeps each unit's shards in host memory and its lazy init refuses a parameter materialised on
    the device ("should be materialized on CPU"), so the parameters are materialised in host memory and
    only the buffers (RoPE frequencies, Ms-PoE ratios, routers' expert bias), which forward reads where
    it computes, on the device. Elsewhere everything on `device`."""
    if cfg.memory.model_states != "host" or device.type == "cpu":
        model.to_empty(device=device)
        return
    materialize_apart(model, device)


def materialize_apart(model: torch.nn.Module, device: torch.device) -> None:
    """The parameters materialised in host memory, the buffers on `device` (memory.model_states = host on an
    accelerator: materialize). Apart so that a CPU test can run it with a stand-in accelerator
    (tests/host_origin.py), `materialize` taking a CPU device for one memory."""
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def mixed_precision(device_type: str, dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in bf16 and gradients reduced in fp32 where gathers_in_bf16
    (accumulated in fp32 across micro-batches without sync too: FSDP2 keeps them in reduce_dtype). Its
    cast_forward_inputs also rounds a block's RoPE tables (cos, sin, fp32 from rope_cos_sin) to bf16, as
    transformers' bf16 RoPE rounds them: measured harmless (bf16 weights, tests/unit/test_bf16_numerics_audit.py's
    2-layer llama at 1,024 tokens: logits 1.32e-2 -> 1.34e-2 relative error against float64)."""
    bf16 = gathers_in_bf16(device_type, dtype)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                reduce_dtype=torch.float32 if bf16 else None)


def root_precision(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The root unit's policy: `mp` without cast_forward_inputs. The model's own inputs are integers (tokens,
    positions, document ids, labels) but for train.loss_weighting = sequence's label weights (1 / N_k, fp32),
    which FSDP's cast rounded to bf16 under bf16 gathers: a sequence's weights summed to 1 +- 0.4%
    (tests/distributed/test_fsdp_audit_cast_inputs.py). The blocks keep the cast (their hidden states)."""
    return MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                output_dtype=mp.output_dtype, cast_forward_inputs=False)


def gathers_in_bf16(device_type: str, dtype: str) -> bool:
    """FSDP gathers parameters in bf16 (and reduces gradients in fp32) on GPU where train.dtype computes
    in bf16 there (auto: a card with native bf16). On CPU FSDP keeps fp32: train.dtype = bf16 there is
    bf16 autocast over fp32 weights (matmuls and attention in bf16), as one GPU without FSDP runs it."""
    return device_type == "cuda" and computes_in_bf16(dtype, device_type)


def grad_scale(dims) -> float:
    """What each rank's loss is multiplied by so FSDP's gradient average becomes the global sum."""
    return float(dims.world_size)
