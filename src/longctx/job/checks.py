"""Every layout problem of a config on a number of ranks, found before any process starts work.

Used by the launcher (fail before torchrun starts workers), by each rank at start-up, and by the
planner (is a predicted plan runnable?). The two arithmetic rules of the sequence layouts live here,
below context parallelism, which applies them too: the heads a head-parallel degree can split
(`check_heads`, Ulysses), and the lengths the balanced (zigzag) layout can cut (`check_divisible`).
"""

from __future__ import annotations

import os

from ..config.divisors import among, divisors
from ..config.inert_options import inert_layout_problems
from ..config.rules import global_batch_used, head_fits, parse_stages
from ..errors import ConfigError
from .dims import ParallelDims


def check_layout(cfg, world: int) -> ParallelDims:
    """The validated degrees of `cfg` on `world` ranks, or a ConfigError naming what does not fit."""
    dims = ParallelDims.from_config(cfg, world_size=world)
    check_heads(cfg.model.heads, cfg.model.kv_heads, dims.head)
    if not cfg.train.stages:  # (with stages train.seq_len is the last one's: checked below under their name)
        try:
            check_divisible(cfg.train.seq_len, dims.ctx, dims.head)
        except ConfigError as e:  # (the key: the same rule guards eval's and generate's lengths, which say theirs)
            raise ConfigError(f"train.seq_len with parallel.ctx {dims.ctx} x parallel.head {dims.head}: {e}") from None
    else:
        for i, (seq_len, steps, batch) in enumerate(parse_stages(cfg.train.stages), 1):
            try:
                try:  # (named as the stage: a 4K -> 32K -> 128K plan is read by its stages)
                    check_divisible(seq_len, dims.ctx, dims.head)
                except ConfigError as e:
                    raise ConfigError(f"stage {i} ({seq_len}:{steps}{f':{batch}' if batch else ''}): {e}") from None
                # a stage's own batch is named as the stage's: train.global_batch may be another number
                _check_batch(batch or cfg.train.global_batch, cfg.train.grad_accum, dims,
                             f"stage {i}'s batch ({seq_len}:{steps}:{batch})" if batch else "train.global_batch")
            except ConfigError as e:
                raise ConfigError(f"train.stages: {e}") from None
    if global_batch_used(cfg.train.stages):  # (unused when every stage names its batch)
        _check_batch(cfg.train.global_batch, cfg.train.grad_accum, dims)
    hpz_group(cfg, dims)  # (and node_size, zero_pp_names: all checked before launch)
    node = ranks_per_node(cfg, dims.world_size)  # (after: under hpz / qgz, node_size says what the node must split)
    _check_expert_nodes(cfg.parallel, dims, node)
    replica = dims.world_size // dims.dp_replicate
    if cfg.train.data_parallel == "co2" and dims.expert > 1 and replica % dims.expert:
        raise ConfigError(f"train.data_parallel = co2 keeps each of the {dims.dp_replicate} replicas' weights its own, "
                          f"so its experts must be spread over the replica's {replica} ranks, and parallel.expert = "
                          f"{dims.expert} does not divide them: choose parallel.expert among "
                          f"{[d for d in range(1, replica + 1) if replica % d == 0]}, or fewer replicas.")
    _check_co2_hpz(cfg, dims, replica)
    _check_expert_shards(cfg.model, dims, replica if cfg.train.data_parallel == "co2" else dims.world_size)
    if cfg.parallel.zero_pp_kernels not in ZERO_PP_KERNELS:
        raise ConfigError(f"parallel.zero_pp_kernels must be one of {', '.join(ZERO_PP_KERNELS)}, got "
                          f"{cfg.parallel.zero_pp_kernels!r}.")
    inert = inert_layout_problems(cfg, dims.world_size)  # (options this world size would ignore)
    if inert:
        raise ConfigError(" ".join(inert))
    return dims


def _check_co2_hpz(cfg, dims: ParallelDims, replica: int) -> None:
    """Under co2 each replica is an FSDP group of its own (a mesh of its `replica` ranks only), and hpz's
    post-forward mesh over part of it is a DeviceMesh FSDP2 builds inside fully_shard from that replica's ranks:
    each replica makes other groups, no two agree on a new_group, and every rank hangs in set-up (seen: 8 ranks,
    2 replicas of 4, nodes of 2). A secondary partition of 1 rank (no resharding) or of the whole replica (plain
    resharding) builds no mesh."""
    hpz = hpz_group(cfg, dims) if cfg.train.data_parallel == "co2" else None
    if hpz is None or hpz in (1, replica):
        return
    raise ConfigError(f"train.data_parallel = co2 with parallel.zero_pp = hpz over {hpz} ranks: under co2 each of "
                      f"the {dims.dp_replicate} replicas is an FSDP group of its own {replica} ranks, and FSDP2 "
                      f"builds hpz's secondary partition of part of a replica as a process group every rank must "
                      f"join, which the other replicas' ranks never do (every rank hangs in set-up). Set "
                      f"parallel.ranks_per_node {replica} with parallel.hpz_ranks 0 (the whole replica: plain "
                      f"resharding) or 1 (no resharding after forward), drop hpz from parallel.zero_pp (qwz and qgz "
                      f"work under co2), or use train.data_parallel = sync.")


def _check_expert_nodes(p, dims: ParallelDims, node: int) -> None:
    """parallel.expert_ranks_per_node against the job's nodes (parallel.ranks_per_node, else the launcher's
    LOCAL_WORLD_SIZE; every rank on one machine). Hierarchical dispatch (parallel/expert/hierarchy.py) takes
    every `per_node` consecutive ranks of an expert group for one node: its exchange inside them was meant for
    the fast link, its exchange between them is the one it keeps small. A `per_node` that does not divide the
    machine's ranks puts some of those groups across two machines: the results stay right, but the inside
    exchange crosses the slow link and the saving the option is for is gone without a word. (Its divisor of
    parallel.expert is config/rules.py's.)"""
    per_node = p.expert_ranks_per_node
    if dims.expert < 2 or per_node <= 0 or dims.expert % per_node or node % per_node == 0:
        return
    # (on one machine node is the world, which per_node divides: only a given node size gets here)
    source = f"parallel.ranks_per_node = {node}" if p.ranks_per_node else f"the launcher's LOCAL_WORLD_SIZE={node}"
    fits = [d for d in range(1, min(node, dims.expert) + 1) if node % d == 0 and dims.expert % d == 0]
    raise ConfigError(f"parallel.expert_ranks_per_node = {per_node} takes every {per_node} ranks of an expert group "
                      f"for one node, but the job's nodes hold {node} ranks ({source}): some of those groups would "
                      f"span two nodes and the exchange meant to stay inside one would cross the slow link. Choose "
                      f"among {fits} (divisors of both), or 0 for the flat all-to-all.")


def expert_shards_split(m, world: int, expert: int) -> bool:
    """Whether FSDP can shard a rank's experts over the expert-data group (world / expert ranks) under expert
    parallelism `expert`: the group divides model.dim or model.moe.expert_dim (or there is no group to split)."""
    g = world // expert
    return expert < 2 or g < 2 or m.dim % g == 0 or m.resolved_expert_dim % g == 0


def _check_expert_shards(m, dims: ParallelDims, spread: int) -> None:
    """Under expert parallelism each rank's experts ([experts / expert, expert_dim, dim] and [.., dim, expert_dim])
    are FSDP-sharded over the expert-data group (world / expert ranks) on an inner dim, which FSDP2 splits only
    evenly (parallel/fsdp/shard.py, costs/model_states.py expert_shard_dim): the group must divide model.dim or
    model.moe.expert_dim, or FSDP fails inside set-up on every rank. `spread`: the ranks an expert group must fit in
    (a co2 replica's; else the world), so the degrees named are ones the co2 rule above accepts too."""
    g, world = dims.expert_data, dims.world_size
    if not m.is_moe or expert_shards_split(m, world, dims.expert):
        return
    # (1, no expert parallelism, always works: FSDP shards the whole [experts, ...] tensors over every rank)
    valid = [e for e in range(1, world + 1) if spread % e == 0 and m.moe_experts % e == 0
             and expert_shards_split(m, world, e)]
    raise ConfigError(f"parallel.expert = {dims.expert} on {world} ranks leaves {g} ranks holding the same experts, "
                      f"and FSDP shards each expert's weights over them on model.dim ({m.dim}) or "
                      f"model.moe.expert_dim ({m.resolved_expert_dim}), which must split evenly: {g} divides "
                      f"neither. Choose parallel.expert among {valid} (1: no expert parallelism), or a number of "
                      f"ranks whose ratio to parallel.expert divides one of them.")


def check_heads(heads: int, kv_heads: int, head: int) -> None:
    if heads % head:
        raise ConfigError(
            f"{heads} attention heads are not divisible by the head-parallel degree {head}; "
            f"choose parallel.head among {among(heads)}."
        )
    if heads % kv_heads:
        raise ConfigError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads.")
    if kv_heads % head and head % kv_heads:
        listed = divisors(heads)  # (None: a count too large to list, which said "among []")
        fits = ([d for d in listed if head_fits(heads, kv_heads, d)] if listed is not None else
                f"the divisors of {heads} that divide or are multiples of {kv_heads}")
        raise ConfigError(
            f"{kv_heads} key/value heads cannot be split over head-parallel degree {head}: one must divide "
            f"the other (kv heads are replicated when the degree is a multiple of them); choose parallel.head among "
            f"{fits}, or a model.kv_heads that divides or is a multiple of {head}."
        )


def check_divisible(seq_len: int, ctx: int, head: int) -> None:
    unit = 2 * ctx * head
    if seq_len % unit:
        lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by 2 x ctx x head = 2 x {ctx} x {head} = {unit}, which "
            f"the balanced (zigzag) layout needs; use {lower or upper} or {upper}, or pad explicitly "
            f"(padding must be masked out of the loss)."
        )


def _check_batch(global_batch: int, grad_accum: int, dims: ParallelDims, what: str = "train.global_batch") -> None:
    dp = dims.dp_replicate * dims.dp_shard
    if global_batch % (dp * grad_accum):
        raise ConfigError(
            f"{what} ({global_batch} sequences per optimizer step) must split evenly into "
            f"train.grad_accum ({grad_accum}) micro-batches over the data-parallel degree dp_replicate x "
            f"dp_shard = {dims.dp_replicate} x {dims.dp_shard} = {dp}; use a multiple of {dp * grad_accum}."
        )


ZERO_PP = ("hpz", "qwz", "qgz")  # parallel.zero_pp's names
ZERO_PP_KERNELS = ("auto", "compiled", "eager")  # parallel.zero_pp_kernels (parallel/fsdp/quantized.py)


def ranks_per_node(cfg, world: int) -> int:
    """parallel.ranks_per_node, or the launcher's (LOCAL_WORLD_SIZE; every rank on one machine). A
    given one must divide the world (every node runs as many ranks): the host-memory preflight
    multiplies by it, and a negative count would pass any budget."""
    given = cfg.parallel.ranks_per_node
    if given < 0 or (given and world % given):  # (world >= 1: ParallelDims refuses less)
        raise ConfigError(f"parallel.ranks_per_node = {given} must divide the {world} ranks of the job (each node "
                          f"runs as many): choose among {[d for d in range(1, world + 1) if world % d == 0]}, or 0 "
                          f"for the launcher's (LOCAL_WORLD_SIZE, else every rank on this machine).")
    return given or launcher_node_ranks(world)


def launcher_node_ranks(world: int) -> int:
    """The ranks of this node as a launcher says them (LOCAL_WORLD_SIZE, which check_launcher_env checks), read
    in a launched rank only: in the shell that launches (`--nproc N`: every rank on this machine) one left
    from elsewhere was taken for this job's, and a non-number was int()'s traceback."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # (launch.under_launcher, not imported for it)
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if launched and text.isdigit() else world


def zero_pp_names(cfg) -> list[str]:
    """parallel.zero_pp's names, each checked: a ConfigError for one that is not one."""
    names = [n.strip() for n in cfg.parallel.zero_pp.split(",") if n.strip()]
    for name in names:
        if name not in ZERO_PP:
            raise ConfigError(f"parallel.zero_pp: unknown {name!r}; the names are {', '.join(ZERO_PP)} "
                              f"(comma-separated), or '' for off.")
    return names


def node_size(cfg, dims: ParallelDims) -> int | None:
    """The ranks of a node parallel.zero_pp works with (hpz's secondary partition, qgz's first
    reduction: consecutive ranks of the FSDP group), None when neither is on; a ConfigError when it
    does not split the FSDP group."""
    if not {"hpz", "qgz"} & set(zero_pp_names(cfg)):
        return None
    group = dims.world_size // dims.dp_replicate
    node = cfg.parallel.ranks_per_node or launcher_node_ranks(dims.world_size)
    if node < 1 or group % node:
        raise ConfigError(
            f"parallel.zero_pp={cfg.parallel.zero_pp} works with nodes of {node} ranks, which must split the "
            f"FSDP group of {group} ranks (world {dims.world_size} / dp_replicate {dims.dp_replicate}); "
            f"set parallel.ranks_per_node to a divisor of {group}.")
    return node


def hpz_group(cfg, dims: ParallelDims) -> int | None:
    """The ranks each unit's weights stay sharded over after its forward under parallel.zero_pp = hpz
    (FSDP2's reshard_after_forward as an int: consecutive ranks of the FSDP group, a node's, or the
    smaller level parallel.hpz_ranks names), None without hpz."""
    node = node_size(cfg, dims)
    if "hpz" not in zero_pp_names(cfg):
        return None
    level = cfg.parallel.hpz_ranks
    if level < 0 or (level and node % level):
        raise ConfigError(f"parallel.hpz_ranks = {level}: hpz's secondary partition must split a node of {node} "
                          f"ranks (a divisor of parallel.ranks_per_node), or 0 for the whole node.")
    return level or node
