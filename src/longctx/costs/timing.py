"""Time of one candidate plan: compute from FLOPs, and the communication that compute does not hide.

Per rank and micro-batch unless a name says otherwise (`exposed_fsdp_seconds` is per optimizer
step: its micro-batches differ). Compute: GEMM FLOPs / (peak x gemm_efficiency) + attention FLOPs
/ (peak x attention_efficiency). Communication uses intra-node bandwidth for a group whose ranks
fit in one node under the shape's placement (shape.group_is_intra_node), inter-node bandwidth
otherwise. Ulysses all-to-alls block (fully exposed); ring hops overlap one ring step of attention
compute (a Double-Ring outer hop overlaps a whole inner ring of `window` steps); FSDP gathers /
reduce-scatters overlap their block's compute; offload copies overlap their block's compute;
expert all-to-alls block (fully exposed) and the most loaded expert rank sets the pace;
`hardware.comm_overlap` scales every overlap (0 on CPU). On hardware with a third level (hardware.group_ranks)
FSDP's transfers inside a node run at the group's bandwidth when they stay in one group and at
middle_gbps when they span groups (level_bandwidth); the other groups' still see intra_gbps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..config import ModelConfig
from ..config.per_model import per_model
from ..memory.accounting import ActivationEstimate
from ..memory.policy import MemoryPolicy
from ..models.flops import forward_matmul_flops_per_token, train_flops_per_token
from .hardware import Hardware
from .model_states import fsdp_carried_blocks, param_counts
from .shape import MeshShape, group_is_intra_node


def quantized_bytes(shape: MeshShape) -> float:
    """Bytes per element qwz / qgz send: int8 and one fp32 scale per parallel.zero_pp_block elements."""
    return 1 + 4 / shape.quant_block


def link_bandwidth(hw: Hardware, intra: bool) -> float:
    """Bytes/s of one rank's link: inside a node or between nodes."""
    return (hw.intra_gbps if intra else hw.inter_gbps) * 1e9


def level_bandwidth(hw: Hardware, span: int) -> float:
    """Bytes/s of a collective over `span` consecutive ranks of one node: the group's link when they fit
    in one group of a three-level node (hardware.group_ranks), else the slower link between its groups."""
    if hw.group_ranks and span > hw.group_ranks:
        return hw.middle_gbps * 1e9
    return hw.intra_gbps * 1e9


def exposed(transfer_s: float, compute_s: float, hw: Hardware) -> float:
    """What of a transfer is not hidden behind compute running beside it (hardware.comm_overlap of it can be)."""
    return transfer_s - min(transfer_s, hw.comm_overlap * compute_s)


# ----------------------------------------------------------------------------------------------
# Compute


@dataclass(frozen=True)
class Flops:
    """FLOPs of one rank's micro-batch."""
    gemm_fwd: float       # the forward's matmuls: blocks and LM head
    causal_attn: float    # the attention forward under a plain causal mask
    attn_fwd: float       # the attention forward the documents leave (causal_attn x doc_work)
    rec_gemm: float       # matmuls re-run in backward (recomputation)
    rec_attn: float       # attention re-run in backward (full recomputation)


def forward_gemm_flops(m: ModelConfig, tokens: int) -> float:
    """2 FLOPs per matmul parameter and token in every block (of a MoE layer: its router, the top_k
    experts a token goes through and the shared experts), and the LM head's 2 d V."""
    return tokens * _matmul_flops_per_token(m)


@per_model
def _matmul_flops_per_token(m: ModelConfig) -> float:
    return forward_matmul_flops_per_token(m)


@per_model
def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """models/flops.py train_flops_per_token (MFU's numerator), remembered per model and length: the
    planner asks it of every candidate it times."""
    return train_flops_per_token(m, seq_len)


def causal_attention_flops(m: ModelConfig, tokens: int, seq_len: int) -> float:
    """QK^T and PV: 4 s d per token and layer over a sequence of s, halved by the causal mask."""
    return tokens * m.layers * 2 * seq_len * (m.heads * m.resolved_head_dim)


def micro_batch_flops(m: ModelConfig, tokens: int, seq_len: int, policy: MemoryPolicy, acts: ActivationEstimate,
                      doc_work: float) -> Flops:
    """The FLOPs of a micro-batch of `tokens` rank tokens. The kernels run only same-document pairs,
    and the "docs" balance gives each context rank 1/c of them (parallel/context/doc_balance.py): the rank's
    attention work is the documents' share. acts.recompute_flops counts the re-run attention at the
    causal rate; the rest of it is GEMMs."""
    gemm_fwd = forward_gemm_flops(m, tokens)
    causal_attn = causal_attention_flops(m, tokens, seq_len)
    attn_fwd = causal_attn * doc_work
    full = policy.recompute == "full"
    rec_attn = attn_fwd if full else 0.0
    rec_gemm = max(0.0, acts.recompute_flops - (causal_attn if full else 0.0))
    return Flops(gemm_fwd, causal_attn, attn_fwd, rec_gemm, rec_attn)


def _rates(hw: Hardware) -> tuple[float, float]:
    """FLOP/s of GEMMs and of attention."""
    return hw.peak_flops * hw.gemm_efficiency, hw.peak_flops * hw.attention_efficiency


def compute_seconds(f: Flops, hw: Hardware) -> float:
    """Forward + backward (twice the forward) + recomputation of one micro-batch."""
    gemm_rate, attn_rate = _rates(hw)
    return (3 * f.gemm_fwd + f.rec_gemm) / gemm_rate + (3 * f.attn_fwd + f.rec_attn) / attn_rate


def predicted_block_forward_seconds(f: Flops, m: ModelConfig, hw: Hardware) -> float:
    """One block's forward (the LM head's share spread over the blocks)."""
    gemm_rate, attn_rate = _rates(hw)
    return (f.gemm_fwd / max(m.layers, 1)) / gemm_rate + (f.attn_fwd / max(m.layers, 1)) / attn_rate


def layer_attention_seconds(f: Flops, m: ModelConfig, hw: Hardware) -> float:
    """One layer's attention forward."""
    return f.attn_fwd / max(m.layers, 1) / _rates(hw)[1]


def recompute_share(f: Flops) -> float:
    """The recomputed part of a micro-batch's FLOPs."""
    return (f.rec_gemm + f.rec_attn) / (3 * (f.gemm_fwd + f.attn_fwd) + f.rec_gemm + f.rec_attn)


# ----------------------------------------------------------------------------------------------
# Exposed communication


def exposed_head_seconds(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, per_call: dict, refwd: dict,
                         hw: Hardware, gpus_per_node: int) -> float:
    """The Ulysses all-to-alls of every layer (forward + backward, the forward again under full
    recomputation): blocking, so all of it."""
    if shape.head == 1:
        return 0.0
    bw = link_bandwidth(hw, group_is_intra_node(shape, "head", gpus_per_node)) * hw.all_to_all_efficiency
    seconds = sum(per_call["head"].values()) / bw * m.layers
    if policy.recompute == "full":
        seconds += sum(refwd["head"].values()) / bw * m.layers
    return seconds


def exposed_ring_seconds(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, per_call: dict,
                         layer_attn_s: float, hw: Hardware, gpus_per_node: int) -> float:
    """The ring's c-1 hops per layer (K/V forward, K/V and fp32 dK/dV backward), each overlapping one
    ring step of attention (1/c of the layer's; backward twice the forward); a Double-Ring's c/w-1
    outer hops cross windows and overlap a whole inner ring of w steps."""
    if shape.ctx == 1:
        return 0.0
    c, w = shape.ctx, (shape.window or shape.ctx)
    n_outer = c // w - 1
    n_inner = c - 1 - n_outer
    hop_fwd = per_call["ctx"]["ring_kv"] / (c - 1)
    hop_bwd = (per_call["ctx"]["ring_kv_bwd"] + per_call["ctx"]["ring_dkv"]) / (c - 1)
    bw_in = link_bandwidth(hw, group_is_intra_node(shape, "window", gpus_per_node))
    bw_out = link_bandwidth(hw, group_is_intra_node(shape, "ctx", gpus_per_node))
    step_fwd, step_bwd = layer_attn_s / c, 2 * layer_attn_s / c
    fwd = n_inner * exposed(hop_fwd / bw_in, step_fwd, hw) + n_outer * exposed(hop_fwd / bw_out, w * step_fwd, hw)
    bwd = n_inner * exposed(hop_bwd / bw_in, step_bwd, hw) + n_outer * exposed(hop_bwd / bw_out, w * step_bwd, hw)
    fwd_passes = 2 if policy.recompute == "full" else 1
    return (fwd_passes * fwd + bwd) * m.layers


def fsdp_transfer_seconds(m: ModelConfig, shape: MeshShape, gather_bytes: int, hw: Hardware,
                          gpus_per_node: int, block: int | None = None, root: int | None = None) -> dict[str, float]:
    """Seconds of one block's and of the root's FSDP transfers: the parameter all-gather ((n-1)/n of
    the gathered tensor over the shard group of n) and the gradient reduction (fp32: (n-1)/n
    reduce-scattered, and under HSDP 2 (r-1)/r of the shard all-reduced over the r replicas).
    block, root: the elements their collectives carry (default: the largest block's and the root's
    parameters, param_counts')."""
    pc = param_counts(m)
    b = pc["block"] if block is None else block
    root = pc["root"] if root is None else root
    n, r = shape.fsdp, shape.dp_replicate
    in_node = group_is_intra_node(shape, "fsdp", gpus_per_node)
    bw_f = level_bandwidth(hw, n) if in_node else link_bandwidth(hw, False)
    bw_r = link_bandwidth(hw, group_is_intra_node(shape, "replicate", gpus_per_node))
    modes = set(shape.zero_pp.split(",")) if shape.zero_pp else set()
    node = min(gpus_per_node, n)  # ranks of the FSDP group in one node (hpz, qgz)
    level = shape.hpz_ranks or node  # hpz's secondary partition: a node, or a group inside it (Frontier)
    q = quantized_bytes(shape)
    weights = q if "qwz" in modes else gather_bytes

    def gather(p: int) -> tuple[float, float]:  # forward's all-gather, backward's
        forward = (n - 1) / n * p * weights / bw_f
        if "hpz" in modes:  # backward gathers the secondary partition's copy, inside it, unquantised
            return forward, (level - 1) / level * p * gather_bytes / level_bandwidth(hw, level)
        return forward, forward

    def reduce(p: int) -> float:
        # co2: each replica is its own FSDP group, no gradient crosses replicas (its outer all-reduce: planner)
        replicas = 0.0 if shape.data_parallel == "co2" else 2 * (r - 1) / r * p * 4 / n / bw_r
        if "qgz" in modes:  # int8 all-to-all within the node, then the node sums across nodes
            within = (node - 1) / node * p * q / level_bandwidth(hw, node)
            nodes = n // node
            return within + (nodes - 1) / nodes * p / node * q / bw_f + replicas
        return (n - 1) / n * p * 4 / bw_f + replicas

    block_fwd, block_bwd = gather(b)
    root_fwd, _ = gather(root)
    return {"block_gather": block_fwd, "block_gather_bwd": block_bwd, "block_reduce": reduce(b),
            "root_gather": root_fwd, "root_reduce": reduce(root)}


def expert_unit_seconds(shape: MeshShape, params: int, gather_bytes: int, hw: Hardware,
                        gpus_per_node: int) -> tuple[float, float, float]:
    """(forward gather, backward gather, gradient reduce-scatter) seconds of one MoE layer's routed-expert
    unit under expert parallelism: `params` (its expert group's share) over the expert-data group of
    world / expert ranks, no replicas. qwz's int8 gathers apply to it, hpz does not (it reshards fully, so
    backward gathers over the whole group again) and neither does qgz (FSDP's own fp32 reduce-scatter):
    parallel/fsdp/shard.py, the bytes of parallel/context/volumes.py fsdp_bytes_per_step."""
    k = shape.expert_data
    if not params or k == 1:
        return 0.0, 0.0, 0.0
    bw = level_bandwidth(hw, k) if group_is_intra_node(shape, "expert_data", gpus_per_node) else \
        link_bandwidth(hw, False)
    weights = quantized_bytes(shape) if "qwz" in shape.zero_pp.split(",") else gather_bytes
    gather = (k - 1) / k * params * weights / bw
    return gather, gather, (k - 1) / k * params * 4 / bw


def exposed_fsdp_seconds(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, grad_accum: int,
                         gather_bytes: int, block_fwd_s: float, recompute_flops: float, hw: Hardware,
                         gpus_per_node: int) -> float:
    """FSDP time of the whole optimizer step that its block's compute does not hide. A block's
    gather overlaps its forward and again its backward (with its share of recomputation); the
    root's gather and reduce are not hidden; gradients are reduced in the last micro-batch's
    backward only (gradient sync is off for the others) unless grad_sync is per micro_batch."""
    if shape.world == 1:
        return 0.0
    x, units = _fsdp_units(m, shape, gather_bytes, hw, gpus_per_node)
    block_bwd = 2 * block_fwd_s + (recompute_flops / max(m.layers, 1)) / _rates(hw)[0]
    last = others = 0.0
    for count, gather, again, reduce in units:
        last += count * (exposed(gather, block_fwd_s, hw) + exposed(again + reduce, block_bwd, hw))
        others += count * (exposed(gather, block_fwd_s, hw) + exposed(again, block_bwd, hw))
    last_micro = last + x["root_gather"] + x["root_reduce"]
    other_micro = last_micro if policy.grad_sync == "micro_batch" else others + x["root_gather"]
    return last_micro + (grad_accum - 1) * other_micro


@per_model
def _fsdp_units(m: ModelConfig, shape: MeshShape, gather_bytes: int, hw: Hardware,
                gpus_per_node: int) -> tuple[dict[str, float], tuple[tuple[int, float, float, float], ...]]:
    """exposed_fsdp_seconds' transfers, a function of its arguments alone (remembered: the planner times
    thousands of candidates of one layout): the root's and the largest block's (fsdp_transfer_seconds), and
    (count, forward gather, backward gather, reduce) seconds of each size of block. A MoE model's blocks differ
    (dense layers, MoE layers); under expert parallelism a MoE layer's routed experts are units of their own over
    the expert-data group (parallel/fsdp/shard.py), a rank gathering its expert group's share: timed apart
    (expert_unit_seconds). Blocks of one size cost the same: counted. Sizes are what the collectives carry,
    the tensors padded as FSDP2 pads them (costs/model_states.py fsdp_carried_blocks: a MoE layer's [experts,
    ...] tensors over more ranks than experts move group / experts times their size)."""
    blocks, root = fsdp_carried_blocks(m, shape)
    units = []
    for (params, experts), count in Counter(blocks).items():
        b = fsdp_transfer_seconds(m, shape, gather_bytes, hw, gpus_per_node, block=params, root=root)
        x_gather, x_again, x_reduce = expert_unit_seconds(shape, experts, gather_bytes, hw, gpus_per_node)
        units.append((count, b["block_gather"] + x_gather, b["block_gather_bwd"] + x_again,
                      b["block_reduce"] + x_reduce))
    largest = max(params + experts * shape.expert for params, experts in blocks)  # (as param_counts' "block")
    return fsdp_transfer_seconds(m, shape, gather_bytes, hw, gpus_per_node, block=largest, root=root), tuple(units)


def exposed_offload_seconds(m: ModelConfig, policy: MemoryPolicy, acts: ActivationEstimate, block_fwd_s: float,
                            hw: Hardware) -> float:
    """Activation offload: each offloaded block's host tier goes out during its forward and comes
    back during its backward (twice the forward), over the host link."""
    if not acts.per_block_host:
        return 0.0
    offloaded = max(0, m.layers - policy.offload_skip_last)
    x = acts.per_block_host / (hw.host_link_gbps * 1e9)
    return offloaded * (exposed(x, block_fwd_s, hw) + exposed(x, 2 * block_fwd_s, hw))


def exposed_attention_offload_seconds(m: ModelConfig, policy: MemoryPolicy, traffic: float, layer_attn_s: float,
                                      hw: Hardware) -> float:
    """memory.attention_offload: a block's chunk copies (`traffic` bytes) overlap its attention work
    (forward, backward twice the forward, and the recomputed forward under full)."""
    if not traffic:
        return 0.0
    attn_block = (3 + (1 if policy.recompute == "full" else 0)) * layer_attn_s
    return m.layers * exposed(traffic / (hw.host_link_gbps * 1e9), attn_block, hw)


def exposed_expert_seconds(m: ModelConfig, shape: MeshShape, expert_step_bytes: dict, grad_accum: int, tokens: int,
                           skew: float, hw: Hardware, gpus_per_node: int) -> float:
    """Expert parallelism, per micro-batch, on the most loaded rank (receiving `skew` x its share of
    the routed rows): the MoE layers' all-to-alls (blocking; the group's exchange ends when that
    rank's share is through, skew x the even one) and the experts' GEMMs of its rows beyond its
    share, which every other rank of the group waits for (FlexMoE's straggler)."""
    if shape.expert == 1 or not expert_step_bytes:
        return 0.0
    bw = link_bandwidth(hw, group_is_intra_node(shape, "expert", gpus_per_node)) * hw.all_to_all_efficiency
    transfer = sum(expert_step_bytes.values()) / grad_accum / bw * max(skew, 1.0)
    return transfer + expert_straggler_seconds(m, tokens, skew, hw)


def expert_straggler_seconds(m: ModelConfig, tokens: int, skew: float, hw: Hardware) -> float:
    """The experts' GEMMs of the most loaded rank's routed rows beyond its even share, per micro-batch: forward +
    backward (3x) of 2 FLOPs per weight of the 3 expert matmuls, for each of a token's k rows."""
    routed_flops = 3 * 2 * 3 * m.dim * m.resolved_expert_dim * m.moe_top_k * tokens * len(m.moe_layer_ids)
    return (max(skew, 1.0) - 1.0) * routed_flops / _rates(hw)[0]
