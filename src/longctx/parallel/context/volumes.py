"""Closed-form communication volumes of 2D attention, per rank and per call, by mesh dim and label.

These are the formulas of REFERENCES.md made exact for our implementation; comm.py's counters are
tested to equal them to the byte, and the benchmark and planner report them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ulysses import kv_replication

DOC_ID_BYTES = 8  # int64


@dataclass(frozen=True)
class ZeroPP:
    """parallel.zero_pp as the byte counts need it: its parts (hpz, qwz, qgz), the quantization block,
    the ranks of a node (qgz's first reduction) and hpz's secondary partition (0: the node)."""

    parts: frozenset = frozenset()
    block: int = 512
    node: int = 0
    hpz: int = 0

    def int8(self, elements: float) -> float:
        """Bytes of `elements` values as int8 blocks with one fp32 scale each (unpadded)."""
        return elements * (1 + 4 / self.block)


def fsdp_bytes(params: int, shard: int, replicas: int, gather_bytes: int, root_params: int = 0,
               grad_accum: int = 1, grad_sync: str = "step", zero_pp: ZeroPP = ZeroPP()) -> float:
    """FSDP2 traffic per rank and optimizer step of `grad_accum` micro-batches (its collectives run
    inside PyTorch; job/traffic.py library_traffic measures them). Every micro-batch all-gathers every block's
    parameters (gather_bytes each) for forward and again for backward, the root module's
    `root_params` (embeddings, final norm, LM head) once (FSDP2 does not reshard the root after
    forward), each (n-1)/n of the gathered tensor. The gradients cross once per step (grad_sync
    "step": the training loop turns gradient sync off for all micro-batches but the last; with
    "micro_batch" after every micro-batch): fp32 gradients reduce-
    scattered over the `shard` group ((n-1)/n of them) and, with HSDP, the fp32 gradient shards
    all-reduced over `replicas` (2 (r-1)/r of the shard).

    Under `zero_pp` (parallel/fsdp/shard.py, quantized.py; costs/link_bytes.py splits them by link):
    qwz sends every gather as int8 blocks with an fp32 scale each (1 + 4 / block bytes per element);
    hpz gathers the blocks for backward within its secondary partition of h ranks ((h-1)/h of them,
    unquantised); qgz replaces the reduce-scatter by two all-to-alls of int8 blocks: within the node
    (ranks - 1 rows of nodes x n values, n = params / shard) then across nodes (nodes - 1 rows of n).
    A hpz partition as large as the shard group is none (`hpz_partition`: FSDP2 reshards fully)."""
    if shard * replicas == 1:
        return 0.0
    blocks = params - root_params
    forward = zero_pp.int8(1) if "qwz" in zero_pp.parts else gather_bytes  # bytes per gathered element
    gathers = (shard - 1) / shard * (blocks + root_params) * forward
    if hpz_partition(zero_pp, shard):
        h = zero_pp.hpz or zero_pp.node
        gathers += (h - 1) / h * blocks * gather_bytes
    else:
        gathers += (shard - 1) / shard * blocks * forward
    if "qgz" in zero_pp.parts:
        ranks = zero_pp.node
        nodes = shard // ranks
        reduces = zero_pp.int8(((ranks - 1) * nodes + nodes - 1) * params / shard)
    else:
        reduces = (shard - 1) / shard * params * 4
    reduces += 2 * (replicas - 1) / replicas * params * 4 / shard
    return gathers * grad_accum + reduces * (grad_accum if grad_sync == "micro_batch" else 1)


def frozen_forward_bytes(params: int, shard: int, gather_bytes: int, grad_accum: int = 1,
                         zero_pp: ZeroPP = ZeroPP()) -> float:
    """FSDP2 traffic per rank and optimizer step of a frozen model sharded over the same `shard` ranks (a
    draft's target, train/glide.py): every micro-batch all-gathers all of its parameters once, for a forward
    under no_grad (resharded after it, the root too); no backward gather, no gradient to reduce."""
    forward = zero_pp.int8(1) if "qwz" in zero_pp.parts else gather_bytes
    return (shard - 1) / shard * params * forward * grad_accum


def fsdp_bytes_per_step(num_params: int, root_params: int, dims, grad_accum: int,
                        gather_bytes: int, grad_sync: str = "step", expert_params: int = 0,
                        replicas_sync: bool = True, zero_pp: ZeroPP = ZeroPP(),
                        frozen_params: int = 0) -> dict[str, float]:
    """{"fsdp": bytes} one rank sends per optimizer step through FSDP2 ({} on one rank): `fsdp_bytes`
    over the shard group dp_shard x head x ctx and the dp_replicate replicas of `dims` (anything
    with those four degrees: parallel.dims.ParallelDims in the training loop's metrics line,
    planner.shape.MeshShape in the planner's estimate). num_params: all parameters; root_params:
    the root module's (embeddings, final norm, LM head), gathered once per micro-batch.

    Under expert parallelism (dims.expert > 1), `expert_params` (the MoE layers' routed-expert
    weights, all experts) are their own FSDP units over the expert-data group of world / expert
    ranks, without replicas, each rank's expert group holding 1 / expert of them (parallel/expert/install.py).
    `replicas_sync=False` (train.data_parallel = co2): the replicas exchange nothing per step (each is
    its own FSDP group; CO2's outer all-reduce is counted where it runs, in job/comm.py). `zero_pp`:
    parallel.zero_pp's parts, on the dense units' FSDP group (fsdp_bytes). `frozen_params`: a frozen model
    sharded beside them (a draft's target: frozen_forward_bytes), which a draft run's step gathers too."""
    shard, replicas = dims.dp_shard * dims.head * dims.ctx, dims.dp_replicate if replicas_sync else 1
    ep = getattr(dims, "expert", 1)
    if ep == 1 or not expert_params:
        if shard * replicas == 1:
            return {}
        return {"fsdp": fsdp_bytes(num_params, shard, replicas, gather_bytes, root_params, grad_accum, grad_sync,
                                   zero_pp) + frozen_forward_bytes(frozen_params, shard, gather_bytes, grad_accum,
                                                                   zero_pp)}
    dense = fsdp_bytes(num_params - expert_params, shard, replicas, gather_bytes, root_params, grad_accum, grad_sync,
                       zero_pp)
    # the experts' units: qwz's int8 gathers too (parallel/fsdp/shard.py quantize_gathers), no hpz (they keep
    # plain resharding), FSDP's own reduce-scatter (qgz is the dense units')
    quantized = ZeroPP(frozenset({"qwz"}), zero_pp.block) if "qwz" in zero_pp.parts else ZeroPP()
    experts = fsdp_bytes(expert_params // ep, shard * replicas // ep, 1, gather_bytes, 0, grad_accum, grad_sync,
                         quantized)
    return {"fsdp": dense + experts} if dense + experts else {}


def hpz_partition(zero_pp: ZeroPP, shard: int) -> bool:
    """Whether hpz partitions a shard group of `shard` ranks: its partition (hpz ranks, or the node) is
    smaller than the group (parallel/fsdp/shard.py quantize_gathers' rule)."""
    return "hpz" in zero_pp.parts and (zero_pp.hpz or zero_pp.node) < shard


def expert_bytes(*, tokens: float, top_k: int, experts: int, dim: int, expert: int, elem: int,
                 forwards: float = 1.0) -> dict[str, float]:
    """{label: bytes} one rank sends in one MoE layer's expert all-to-alls (parallel/expert/install.py) for
    `tokens` routed tokens when routing is even: each token's top_k rows, (expert - 1) / expert of
    them to other ranks of its expert group, `dim` x `elem` bytes each. A forward sends them
    (dispatch) and as many rows back to their tokens' ranks (combine); backward sends the same two
    again, reversed; `forwards` counts the forward runs (1 + the recomputed share: a recomputed MoE
    feed-forward dispatches again). "expert_counts": the int64 rows per expert each forward sends
    its group's other ranks (experts / expert of them to each). With uneven routing a rank's bytes
    follow its routed counts instead (tests/distributed/test_expert_parallel.py checks that form)."""
    if expert == 1:
        return {}
    rows = tokens * top_k * (expert - 1) / expert
    return {"expert": 2 * (forwards + 1) * rows * dim * elem,
            "expert_counts": forwards * experts * 8 * (expert - 1) / expert}


def attention_bytes(*, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int, head: int, ctx: int,
                    elem: int, docs: bool = False, backward: bool = True,
                    docs_stay: bool = False) -> dict[str, dict[str, int]]:
    """{dim: {label: bytes this rank sends}} for one distributed_attention call (forward [+ backward]).

    docs: document ids given WITHOUT a sequence layout, so the call gathers them once (head, then ctx)
    to plan its blocks. With a layout (the training loop's case) documents cost no bytes at all: the
    layout already knows every rank's ids. docs_stay: every document lies on one context rank (the
    batch's SequenceLayout.documents_stay_on_their_rank): the ring is skipped, no ring_kv, ring_kv_bwd
    or ring_dkv bytes (the Ulysses all-to-alls are unchanged)."""
    s_loc = seq // (head * ctx)
    kv_rep = kv_heads * kv_replication(kv_heads, head)
    q_bytes = batch * s_loc * heads * head_dim * elem
    kv_bytes = batch * s_loc * kv_rep * head_dim * elem
    block = 2 * batch * (seq // ctx) * (kv_rep // head) * head_dim  # K and V of one ring block, elements
    out: dict[str, dict[str, int]] = {}
    if head > 1:
        # q, k, v in and the output back, each (h-1)/h of the local slice; the same again in backward
        a2a = (head - 1) * (2 * q_bytes + 2 * kv_bytes) // head
        out["head"] = {"all_to_all": a2a}
        if backward:
            out["head"]["all_to_all_bwd"] = a2a
        if docs:
            out["head"]["unshard"] = batch * s_loc * DOC_ID_BYTES * (head - 1)
    if ctx > 1 and not docs_stay:
        # c-1 K/V blocks forward; backward again c-1 K/V blocks plus c-1 dK/dV blocks in fp32
        out["ctx"] = {"ring_kv": (ctx - 1) * block * elem}
        if backward:
            out["ctx"]["ring_kv_bwd"] = (ctx - 1) * block * elem
            out["ctx"]["ring_dkv"] = (ctx - 1) * block * 4
    if ctx > 1 and docs:
        out.setdefault("ctx", {})["unshard"] = (ctx - 1) * batch * (seq // ctx) * DOC_ID_BYTES
    return out
