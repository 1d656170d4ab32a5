"""Model-state memory of one rank: parameter counts, the sharded states, and what FSDP gathers.

Model states are fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter; FSDP2
keeps the sharded parameters fp32 under bf16 mixed precision too, the bf16 copies are the gathered
ones) sharded over dp_shard x head x ctx (FSDP2, hybrid ZeRO) and replicated over dp_replicate
(HSDP). On top of them FSDP holds the blocks it has unsharded at a time (this one and the
prefetched next) and the root (embeddings, final norm, LM head), which stays gathered for the
whole step. tests/distributed/test_fsdp_bytes.py compares these with a real FSDP2 step.

Mixture of Experts: every expert is a parameter of its layer, so model states, gradients and the
gathered blocks count all of them (models/flops.py `moe_ffn_params` with active=False); FLOPs
count the experts a token goes through (active=True). A MoE model's blocks differ (model.moe.
dense_layers keep a dense SwiGLU): `block_params` lists them, and "block" below is the largest, the
one FSDP's gather peaks on.

Expert parallelism (shape.expert > 1, parallel/expert/install.py): each MoE layer's routed experts are
split over an expert group, E / expert per rank, and FSDP shards those over the expert-data group
(world / expert ranks, no replicas). A rank then holds 1 / world of the routed experts at rest, as
a fully sharded run would, and gathers only its group's 1 / expert of them for a layer: what
expert parallelism saves is the gathered working set, the gradient accumulated unsharded, and the
traffic, not the states at rest (which are already 1 / world under FSDP over every rank).
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..config.model_name import count_words, model_line
from ..config.per_model import per_model
from ..models.flops import layer_matmul_params, moe_ffn_params
from ..models.llama import build_model
from .shape import MeshShape


def routed_expert_params(m: ModelConfig) -> int:
    """One MoE layer's routed experts' weights (w1, w3, w2 of every expert; 0 for a dense model):
    the parameters expert parallelism splits."""
    return 3 * m.moe_experts * m.dim * m.resolved_expert_dim if m.is_moe else 0


def _block_extras(m: ModelConfig) -> int:
    """A block's parameters besides its matmuls: two RMSNorms, the q/k norms (each head's vector, or
    the whole projection: model.qk_norm_span), the attention biases."""
    hd = m.resolved_head_dim
    qk = 0
    if m.qk_norm:  # qk_norm_span: "all" normalises the whole q and k projections
        qk = (m.heads + m.kv_heads) * hd if getattr(m, "qk_norm_span", "head") == "all" else 2 * hd
    return (2 * m.dim + qk + ((m.heads + 2 * m.kv_heads) * hd if m.qkv_bias else 0)
            + (m.dim if m.out_bias else 0))


@per_model
def _block_params(m: ModelConfig) -> tuple[int, ...]:
    extras = _block_extras(m)
    return tuple(n + extras for n in layer_matmul_params(m))


def block_params(m: ModelConfig) -> list[int]:
    """Parameters of every block, in order: a MoE block with all its experts."""
    return list(_block_params(m))


def param_counts(m: ModelConfig, expert: int = 1) -> dict[str, int]:
    """Parameters of the largest block (every block of a dense model), of the root module
    (embeddings, final norm, LM head), in total (every expert of a MoE model), and "experts": the
    routed experts of every MoE layer. expert: the expert-parallel degree, under which "block" is the
    largest block as one rank gathers it (its group's 1 / expert of a MoE layer's routed experts)."""
    return dict(_param_counts(m, expert))


@per_model
def _param_counts(m: ModelConfig, expert: int) -> dict[str, int]:
    routed = routed_expert_params(m)
    sparse = set(m.moe_layer_ids)
    blocks = block_params(m)
    gathered = [n - (routed - routed // expert if i in sparse else 0) for i, n in enumerate(blocks)]
    root = m.vocab_size * m.dim + m.dim + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return {"block": max(gathered), "root": root, "total": sum(blocks) + root, "experts": routed * len(sparse)}


def predicted_active_params(m: ModelConfig) -> int:
    """Parameters a token goes through: all but the routed experts it is not sent to (param_counts'
    total for a dense model)."""
    n_moe = len(m.moe_layer_ids)
    return param_counts(m)["total"] - n_moe * (moe_ffn_params(m, active=False) - moe_ffn_params(m, active=True))


def params_text(m: ModelConfig) -> str:
    """'8.03B parameters', or for a MoE model '30.5B parameters, 3.35B active'."""
    total = param_counts(m)["total"]
    return f"{count_words(total)} parameters" + (f", {count_words(predicted_active_params(m))} active"
                                                 if m.is_moe else "")


def model_said(m: ModelConfig, spec: str) -> str:
    """The model of the weights `spec` read as `m` in words, with its parameters (params_text) and the step read:
    what generate, eval and a fine-tune or a draft's training say of it (config/model_name.py model_line)."""
    return model_line(m, spec, params_text(m))


def predicted_model_state_bytes(m: ModelConfig, shape: MeshShape) -> float:
    """Bytes of model states per rank: fp32 parameters, gradients and AdamW's exp_avg and exp_avg_sq
    (16 per parameter) of the rank's shards (rank_shard_numels: FSDP2's padded shards, the largest rank's),
    sharded over the FSDP group and replicated over dp_replicate; under expert parallelism the routed
    experts sharded over every rank (1 / expert each, FSDP over world / expert). Not total / group: a MoE
    layer's [experts, ...] tensors over more ranks than experts keep a whole (padded) expert on each."""
    return 16.0 * _shard_total(m, shape.fsdp if shape.world > 1 else 1, shape.expert, shape.expert_data,
                               even_shards(shape))


@per_model
def _param_table(m: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the model, as models/ builds it (on meta; once per model)."""
    return tuple((name, tuple(p.shape)) for name, p in build_model(m, "meta").named_parameters())


@per_model
def _param_shapes(m: ModelConfig) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """(shape, is a routed expert's) of every parameter of the model."""
    return tuple((shape, ".experts." in name) for name, shape in _param_table(m))


# FSDP2 pads every rank's shard to torch.chunk's first (ceil(n / group) rows of dim 0), so a tensor with
# fewer rows than ranks (128 experts' [experts, hidden, dim] weights over 512 ranks) keeps a whole row on
# 128 ranks and nothing but padding on the other 384: 4x the even share per rank, for every MoE layer.
# Sharding another dim that the group divides evenly gives each rank exactly 1 / group. FSDP2 shards a dim
# other than 0 only where the group divides it, and it then interleaves chunks on every gather and
# reduce-scatter (one more copy of the unit), so dim 0 stays unless its fullest shard is over 1.25x the even one.
# Under hpz dim 0 stays everywhere: FSDP2's reshard to the node after forward cuts the gathered flat buffer as
# dim 0's layout (parallel/fsdp/shard.py).
UNEVEN_SHARE_MAX = 1.25


def shard_dim(dims: tuple[int, ...] | list[int], group: int) -> int:
    """The dim FSDP2 shards a tensor of shape `dims` on over `group` ranks (parallel/fsdp/shard.py's
    placement): 0, or the first other dim `group` divides where dim 0's padded shard holds over
    UNEVEN_SHARE_MAX x the even share (numel / group)."""
    if len(dims) < 2 or group <= 1 or dims[0] % group == 0:
        return 0
    fullest = -(-dims[0] // group) * group  # rows of dim 0 a rank pads to, x group, against dims[0]
    if fullest <= UNEVEN_SHARE_MAX * dims[0]:
        return 0
    return next((d for d in range(1, len(dims)) if dims[d] % group == 0), 0)


def expert_shard_dim(dims: tuple[int, ...] | list[int], group: int) -> int:
    """The dim FSDP2 shards a routed expert tensor on over the expert-data group under expert parallelism (dim 0
    is the expert group's): 1, or 2 where the group divides only that one (job/checks.py refuses a layout where
    it divides neither)."""
    return 2 if group > 1 and dims[1] % group and not dims[2] % group else 1


def rank_shard_numels(m: ModelConfig, shape: MeshShape) -> list[int]:
    """Elements of each parameter's shard on one rank, as FSDP2 keeps it (the largest rank's: torch.chunk's
    first chunk, which FSDP pads every rank's to): shard_dim's dim (mostly 0) over the FSDP group; under
    expert parallelism the routed experts 1 / expert of dim 0, then expert_shard_dim's over the expert-data
    group (parallel/fsdp/shard.py). One rank: the whole tensors."""
    group = shape.fsdp if shape.world > 1 else 1
    return list(_shard_numels(m, group, shape.expert, shape.expert_data, even_shards(shape)))


def even_shards(shape: MeshShape) -> bool:
    """Whether FSDP picks shard_dim's dim for each parameter (False under hpz: dim 0 everywhere)."""
    return "hpz" not in shape.zero_pp.split(",")


def param_cut(dims, group: int, even: bool = True) -> tuple[int, int, int]:
    """(the size of the dim FSDP2 cuts a tensor of shape `dims` on over `group` ranks: shard_dim's, dim 0 where
    not `even`; the rows of it a rank pads to, torch.chunk's first chunk; the elements per row). A scalar is one
    row of one element."""
    dims = tuple(dims) or (1,)
    n = dims[shard_dim(dims, group) if even else 0]
    return n, -(-n // group), math.prod(dims) // n if n else 0


def param_shard(dims, routed: bool, group: int, expert: int = 1, expert_data: int = 1,
                even: bool = True) -> tuple[int, int]:
    """(elements of the fullest rank's shard, the ranks the tensor is cut over) of one parameter of shape `dims`
    as FSDP2 shards it (parallel/fsdp/shard.py): shard_dim's dim (dim 0 where not `even`, i.e. under hpz) over
    the FSDP `group`; a routed expert's under expert parallelism 1 / `expert` of dim 0, then expert_shard_dim's
    over the `expert_data` group. Its collectives carry elements x ranks (the padding included)."""
    if not (routed and expert > 1):
        _, chunk, rest = param_cut(dims, group, even)
        return chunk * rest, group
    dims = [-(-dims[0] // expert), *dims[1:]]  # (the expert group's share of the experts)
    d = expert_shard_dim(dims, expert_data)
    dims[d] = -(-dims[d] // expert_data)
    return math.prod(dims), expert_data


@per_model
def _shard_total(m: ModelConfig, group: int, expert: int, expert_data: int, even: bool) -> int:
    """sum(rank_shard_numels) of a rank (its arguments: rank_shard_numels'), remembered: every candidate of a
    plan asks it several times (an int sum, so the same value as summing the list each time)."""
    return sum(_shard_numels(m, group, expert, expert_data, even))


@per_model
def _shard_numels(m: ModelConfig, group: int, expert: int, expert_data: int, even: bool) -> tuple[int, ...]:
    return tuple(param_shard(dims, routed, group, expert, expert_data, even)[0] for dims, routed in _param_shapes(m))


def fsdp_carried(params, group: int, expert: int = 1, expert_data: int = 1, even: bool = True) -> dict[str, int]:
    """The parameters FSDP2's collectives carry, as fsdp_bytes_per_step (parallel/context/volumes.py) takes them:
    {"total", "root", "experts"} of `params`, (shape, is a routed expert's, is the root module's) each, every
    tensor padded as FSDP2 shards it (param_shard: its all-gathers and reduce-scatters move the ranks x the
    padded shard; "experts": the routed experts under expert parallelism, `expert` x one group's, as the
    function divides it). Unpadded counts read low wherever a group does not divide the dim FSDP cuts: 9% on
    debug-moe over 3 ranks; under hpz (`even` False: dim 0) a [experts, ...] tensor over more ranks than experts
    moves group / experts times its size."""
    total = root = experts = 0
    for dims, routed, is_root in params:
        shard, ranks = param_shard(dims, routed, group, expert, expert_data, even)
        carried = shard * ranks
        ep = routed and expert > 1
        experts += expert * carried if ep else 0
        root += carried if is_root else 0
        total += carried * (expert if ep else 1)
    return {"total": total, "root": root, "experts": experts}


@per_model
def _param_blocks(m: ModelConfig) -> tuple[int, ...]:
    """The block of each parameter (in _param_shapes' order); -1: the root module's."""
    return tuple(int(name.split(".")[1]) if name.startswith("layers.") else -1 for name, _ in _param_table(m))


def unit_param_shapes(m: ModelConfig) -> list[list[tuple[int, ...]]]:
    """The shapes of each block's parameters, in block order, then the root module's (FSDP's units)."""
    units: list[list[tuple[int, ...]]] = [[] for _ in range(m.layers + 1)]
    for (dims, _), block in zip(_param_shapes(m), _param_blocks(m), strict=True):
        units[block].append(dims)
    return units


def unit_param_parts(m: ModelConfig) -> list[dict[str, list[tuple[int, ...]]]]:
    """unit_param_shapes split by what FSDP does with them under expert parallelism (parallel/fsdp/shard.py):
    per block and then the root, {"dense": the block's own unit, "router": the MoE routers' (their own units
    where the blocks gather bf16), "experts": the routed experts' (their own unit over the expert-data group)}."""
    units: list[dict[str, list[tuple[int, ...]]]] = [{"dense": [], "router": [], "experts": []}
                                                     for _ in range(m.layers + 1)]
    for (name, dims), (_, routed), block in zip(_param_table(m), _param_shapes(m), _param_blocks(m), strict=True):
        part = "experts" if routed else "router" if ".feed_forward.router." in name else "dense"
        units[block][part].append(dims)
    return units


def fsdp_carried_params(m: ModelConfig, shape: MeshShape) -> dict[str, int]:
    """fsdp_carried of `m`'s parameters over `shape`'s FSDP group (dp_shard x head x ctx) and expert groups."""
    return dict(_carried_params(m, shape.fsdp, shape.expert, shape.expert_data, even_shards(shape)))


@per_model
def _carried_params(m: ModelConfig, group: int, expert: int, expert_data: int,
                    even: bool) -> tuple[tuple[str, int], ...]:
    params = [(dims, routed, block < 0) for (dims, routed), block in zip(_param_shapes(m), _param_blocks(m),
                                                                          strict=True)]
    return tuple(fsdp_carried(params, group, expert, expert_data, even).items())


def fsdp_carried_blocks(m: ModelConfig, shape: MeshShape) -> tuple[tuple[tuple[int, int], ...], int]:
    """((dense, experts) per block, root): the elements FSDP2's collectives carry for each unit, padded as
    fsdp_carried pads them: a block's parameters but its routed experts under expert parallelism (over the FSDP
    group), those experts' share its expert group gathers (over the expert-data group; 0 without expert
    parallelism, where they are the block's), and the root module's."""
    return _carried_blocks(m, shape.fsdp, shape.expert, shape.expert_data, even_shards(shape))


@per_model
def _carried_blocks(m: ModelConfig, group: int, expert: int, expert_data: int, even: bool):
    dense, experts, root = [0] * m.layers, [0] * m.layers, 0
    for (dims, routed), block in zip(_param_shapes(m), _param_blocks(m), strict=True):
        apart = routed and expert > 1
        carried = fsdp_carried([(dims, routed, block < 0)], group, expert, expert_data, even)
        if block < 0:
            root += carried["root"]
        elif apart:
            experts[block] += carried["experts"] // expert  # (the expert group's share)
        else:
            dense[block] += carried["total"]
    return tuple(zip(dense, experts)), root


def gathered_param_bytes(m: ModelConfig, shape: MeshShape, gather_bytes: int, sharded: bool | None = None,
                         bucket_blocks: int = 1) -> float:
    """Bytes FSDP holds unsharded per rank (0 without FSDP: one rank, unless `sharded`, as
    memory.model_states = host wraps one rank in a one-rank FSDP group): two units gathered in
    `gather_bytes` per parameter (this one + the prefetched next) and one unit's fp32 gradient
    before its reduce-scatter, a unit being `bucket_blocks` blocks (parallel.grad_bucket_blocks),
    each counted as the largest block (a MoE block with all its experts); the root stays gathered for
    the step, its gradient is fp32 until reduced."""
    if not (shape.world > 1 if sharded is None else sharded):
        return 0.0
    pc = param_counts(m, shape.expert)
    unit = pc["block"] * max(1, min(bucket_blocks, m.layers))
    return 2 * unit * gather_bytes + unit * 4 + pc["root"] * (gather_bytes + 4)


def accumulated_grad_bytes(m: ModelConfig, shape: MeshShape, grad_accum: int, grad_sync: str) -> float:
    """With gradient sync off between micro-batches (grad_accum > 1, grad_sync "step") FSDP2
    accumulates every gradient unsharded, in fp32 (of the routed experts, its expert group's 1 /
    expert); 0 otherwise."""
    if not shape.reduces_alone and grad_accum > 1 and grad_sync == "step":
        pc = param_counts(m)
        return 4 * (pc["total"] - pc["experts"] + pc["experts"] // shape.expert)
    return 0.0


# CO2's OuterSync (step/co2.py): fp32 buffers per parameter of a rank's shard: the round's start, the outer
# model (anchor) and the change in flight (+ the outer momentum when train.co2_outer_momentum > 0)
CO2_COPIES = 3


def co2_params(m: ModelConfig, shape: MeshShape) -> float:
    """Parameters of one rank's shard that CO2 averages (the fullest rank's FSDP2 shards: rank_shard_numels):
    all but the routed experts under expert parallelism (sharded over an expert-data group spanning the
    replicas, they stay synchronous)."""
    shards = rank_shard_numels(m, shape)
    if shape.expert == 1:
        return float(sum(shards))
    return float(sum(n for n, (_, routed) in zip(shards, _param_shapes(m), strict=True) if not routed))


def co2_state_bytes(m: ModelConfig, shape: MeshShape, outer_momentum: bool = False) -> float:
    """CO2's device bytes per rank on top of FSDP's states (step/co2.py OuterSync's fp32 buffers); 0 under
    train.data_parallel = sync."""
    if shape.data_parallel != "co2":
        return 0.0
    return (CO2_COPIES + (1 if outer_momentum else 0)) * 4 * co2_params(m, shape)


def co2_checkpoint_bytes(m: ModelConfig, shape: MeshShape, outer_momentum: bool = False) -> float:
    """The host copy a save takes of a co2 rank's own state (step/co2.py OuterSync.state_dict), held until
    the save is written (an async save's, steps later): its local weights, the round's start, the outer
    model, the change in flight, the outer momentum with `outer_momentum`, and the two AdamW moments, fp32
    each; 0 under train.data_parallel = sync."""
    if shape.data_parallel != "co2":
        return 0.0
    return (1 + CO2_COPIES + (1 if outer_momentum else 0) + 2) * 4 * co2_params(m, shape)
