"""What a Mixture-of-Experts feed-forward leaves for backward, counted per local token and per call
(memory/accounting.py puts these into each MoE block's count): its saved tensors (`moe_ffn_bytes`),
what each call keeps whatever its tokens (`moe_call_bytes`), the calls a memory policy makes
(`moe_calls`) and how many forwards they run (`moe_forward_runs`), and under expert parallelism
the rows the most loaded rank receives (`expert_rows`, bounded by `max_expert_skew`) and what each
received row keeps (`expert_parallel_row_bytes`). Experts per token (k below) are memory/peak_routing.py
`peak_top_k`'s: top_k, or E for a DTS-Gate run, whose step 0 routes every expert.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops.grouped import cpu_kernel_available
from .hier_counts import hier_call_bytes, hierarchical
from .peak_routing import peak_top_k
from .policy import MemoryPolicy


def moe_ffn_bytes(m: ModelConfig, p: int, c: int | None = None) -> float:
    """Bytes per local token a Mixture-of-Experts feed-forward (models/moe.py) leaves for backward
    in a training forward, dropless, in this implementation's graph (its input, the norm's output,
    is the block's: counted in `norm`). `c`: bytes per element of what the matmuls make
    (block_parts.compute_bytes; None: p): under bf16 autocast over fp32 weights (p 4, c 2) the
    router stays fp32 (autocast off) and the expert path is bf16:

    - router (fp32, autocast off): the softmax probabilities [E] (the sigmoid router: its scores [E]
      and their per-token sum); with a z-loss (moe.z_loss > 0) the logits [E] and the log-sum-exp (4)
      its backward reads (without one it is recorded without a gradient); in bf16 the fp32 copy
      of the input the gate multiplies (4 d), and the bf16 norm output is then kept only by the
      shared experts; under autocast the gate keeps the norm's fp32 output itself (4 d), which the
      autocast count of the norm leaves out (block_parts.autocast_norm_bytes);
    - the chosen experts [k] (int64, the weights' gather index); the routing weights [k] (c each,
      as the combine multiplies them: under autocast their bf16 cast), and with renormalised top-k
      (moe.norm_topk, at k > 1; not the switch router, whose weight is its probability) the gathered
      probabilities [k] and their sum, fp32 (at top-1 the renormalised weight is the constant 1, which keeps
      neither: models/moe.py Router._weights);
    - permute (TokenRows): the inverse permutation of the T k slots (int64), which its backward
      gathers by, and the permuted tokens [k, d] (`routed_row_bytes`);
    - the routed experts: SwiGLU intermediates of expert_dim for each of the k slots (w1 out, silu
      out, w3 out, product: 4 x expert_dim, as the dense MLP's 4 x ffn_dim), c each;
    - un-permute, a gather by the same inverse permutation (kept once) and the slots [k, d] (the
      experts' output, c); with a capacity an index_copy instead, which keeps its own index (int64
      [k]) and its source, the experts' output [k, d];
    - shared experts: a SwiGLU of shared_dim (4 x shared_dim, c); with their sigmoid gate, the gate
      (1) and the shared output [d] (c).

    With the top-k choice every token fills exactly k slots, so this is exact (routing only decides
    which expert a slot's rows go to). With a capacity (moe.capacity_factor > 0) the kept choices
    (bool [k]) are added and the T k slots are an upper bound of the rows the experts see."""
    c = p if c is None else c
    d, k, E = m.dim, peak_top_k(m), m.moe_experts
    H, S = m.resolved_expert_dim, m.resolved_shared_dim
    router = 4 * E + (4 * E + 4 if m.moe_z_loss > 0 else 0) + (4 if m.moe_router == "sigmoid" else 0)
    if p != 4:
        router += 4 * d - (0 if S else p * d)
    elif c < p:
        router += 4 * d
    choice = 8 * k + c * k + (4 * k + 4 if m.moe_norm_topk and m.moe_router != "switch" and k > 1 else 0)
    choice += k if m.moe_capacity_factor > 0 else 0
    permute = 8 * k + k * routed_row_bytes(m, p, c)
    experts = 4 * c * k * H
    unpermute = c * k * d + (8 * k + c * k * d if m.moe_capacity_factor > 0 else 0)
    shared = 4 * c * S + ((c + c * d) if m.moe_shared_gate and S else 0)
    return router + choice + permute + experts + unpermute + shared


def routed_row_bytes(m: ModelConfig, p: int, c: int) -> int:
    """Bytes a permuted row keeps for the experts' backward: the row itself (p d), or under autocast (c < p)
    the bf16 cast of it that each of the two grouped GEMMs reading it (w1, w3: ops/grouped.py casts its
    operands) makes and saves. (Experts in checkpointed pieces keep the row itself instead, the piece's
    input: moe_call_terms.)"""
    return 2 * c * m.dim if c < p else p * m.dim


def moe_norm_feeds(m: ModelConfig) -> int:
    """The matmuls under autocast that cast a MoE block's MLP norm output to bf16 and keep the cast (as
    block_parts.autocast_norm_bytes counts them): the shared experts' w1 and w3, and their sigmoid gate. The
    router's gate reads it in fp32 (moe_ffn_bytes) and the routed experts its permuted rows."""
    S = m.resolved_shared_dim
    return (2 if S else 0) + (1 if S and m.moe_shared_gate else 0)


def moe_weight_copy_params(m: ModelConfig, experts_copied: bool, expert: int = 1) -> int:
    """Parameters of a MoE feed-forward whose bf16 copy autocast keeps for backward when the call's saved
    tensors are kept (accounting.layer_activations `autocast`): the shared experts' and their gate's,
    and the routed experts' when they run whole (`experts_copied`; in checkpointed pieces, memory.expert_chunk,
    each piece's copy is made again in backward): under expert parallelism (`expert` > 1) the rank's
    experts / expert of them. The router's gate runs in fp32: none."""
    d, S = m.dim, m.resolved_shared_dim
    shared = 3 * d * S + (d if S and m.moe_shared_gate else 0)
    return shared + (m.moe_experts // expert * 3 * d * m.resolved_expert_dim if experts_copied else 0)


def moe_call_bytes(m: ModelConfig, p: int, stored: bool, experts_chunked: bool = False, c: int | None = None,
                   groups: int | None = None) -> float:
    """Bytes one call of a MoE feed-forward keeps whatever its tokens: what its router records for
    the balancing losses (expert counts and probability sums, fp32 [E] each, the squared log-sum-exp
    sum and the dropped count: 8 E + 8, and where choices can be dropped the rows each expert runs, 4 E;
    on the device, also under a checkpoint); and when the call's
    saved tensors are kept (`stored`: not recomputed), in bf16 the gate's fp32 weight copy its
    linear saves (4 E d), and wherever the grouped GEMM kernel runs its int32 group offsets (3 x 4 E):
    ops/grouped.py runs it for rows of whole 16 bytes (dim and expert_dim), in bf16, and in fp32 on a
    CPU whose torch has the kernel (elsewhere its loop saves no offsets), unless the experts run in
    checkpointed pieces (memory.expert_chunk: `experts_chunked`), which keep none of theirs. `c`: the experts'
    operand bytes (moe_ffn_bytes; under autocast bf16, what decides the kernel's alignment). `groups`: the grouped
    GEMMs' groups (None: every expert; under expert parallelism the rank's experts and copy slots, `gemm_groups`)."""
    E = m.moe_experts
    # where routing can drop choices (a capacity; the Sinkhorn router's padding, counted as a bound) the
    # records' rows each expert runs are a tensor of their own [E] (models/moe_stats.py _rows)
    records = 8 * E + 8 + (4 * E if m.moe_capacity_factor > 0 or m.moe_router == "sinkhorn" else 0)
    if not stored:
        return records
    c = p if c is None else c
    aligned = m.dim % (16 // c) == 0 and m.resolved_expert_dim % (16 // c) == 0
    kernel = aligned and (c != 4 or cpu_kernel_available()) and not experts_chunked
    return records + (4 * E * m.dim if p != 4 else 0) + (12 * (E if groups is None else groups) if kernel else 0)


def gemm_groups(m: ModelConfig, expert: int, replicas: int) -> int:
    """The groups of a call's grouped GEMMs on a rank: every expert; under expert parallelism the rank's own
    experts and its FlexMoE copy slots (parallel/expert/placement.py `copy_slot_weights`, `replicas` of them)."""
    return m.moe_experts if expert <= 1 else m.moe_experts // expert + replicas


def copy_slot_bytes(m: ModelConfig, p: int, expert: int, replicas: int, rows: float, chunked: bool,
                    c: int | None = None) -> float:
    """Bytes a call whose saved tensors are kept holds for FlexMoE's copy slots (parallel.expert_replicas > 0 under
    expert parallelism), beyond the static placement's count, on a rank whose `replicas` slots are all filled (the
    bound: an empty slot is a zero expert and fetches nothing). `rows`: the call's own routed rows (tokens x top_k).
    The rank's own experts run on the parameters, which their grouped GEMMs save at no cost, and its copy slots as
    GEMMs of their own (parallel/expert/placement.py `own_and_copy_experts`) on the fetched copies:
    - the copy slots' w1, w3, w2 (`copy_slot_weights`), replicas x 3 x dim x expert_dim values at p, as their GEMMs
      save them; under autocast (c < p) their bf16 casts instead; with memory.expert_chunk the pieces' checkpoints
      hold them as their input, p (the fetched weights they are selected from are not kept: index_select keeps
      its index only);
    - the rows' slot order and its inverse, int64 per row (the dispatcher's two index_selects, dispatch.py `_run`);
    - the fetch's int64 indices (`_fetch_copies`): each copy slot's row of the copies it receives (`replicas`) and
      of those it sends, at most min(replicas, E / expert) to each other rank of the group (exact where they all
      copy that many).
    The grouped GEMMs' int32 offsets over the slots are moe_call_bytes' (`gemm_groups`: the own experts' GEMMs and
    the copies' hold as many as one GEMM over the slots). (Before 2026-12-05 one GEMM over the own experts and the
    copies joined into new tensors saved those, (E / expert + replicas) x 3 x dim x expert_dim values, and the
    fetched copies were kept once more: E / expert + replicas experts more in fp32.)"""
    if expert <= 1 or replicas <= 0:
        return 0.0
    c = p if c is None else c
    one = 3 * m.dim * m.resolved_expert_dim  # an expert's weights, values
    local = m.moe_experts // expert
    copies = replicas * one * (p if chunked else c)
    indices = 8 * (replicas + (expert - 1) * min(replicas, local))
    return copies + 16 * rows + indices


def _piece_sizes(tokens: int, chunk: int) -> list[int]:
    """Tokens of each piece memory/apply_policy.py `_slices` cuts `tokens` into (none for 0 tokens)."""
    if tokens <= 0:
        return []
    if chunk <= 0 or tokens <= chunk:
        return [tokens]
    return [min(chunk, tokens - s) for s in range(0, tokens, chunk)]


def moe_calls(recompute: str, offloaded: bool, tokens: int, policy: MemoryPolicy) -> list[tuple[int, bool]]:
    """(tokens, stored) of each call of a MoE block's feed-forward in one forward under the policy
    (memory/apply_policy.py): whole, or once per token piece (block_chunk; and under selective + offload
    the stored first offload_fraction of the tokens and the recomputed rest apart). `stored`: the
    call's saved tensors are kept (not recomputed from a checkpoint)."""
    chunk = policy.block_chunk
    if recompute == "none":
        return [(tokens, True)]
    if recompute == "full" or not offloaded:
        return [(n, False) for n in _piece_sizes(tokens, chunk)]
    stored = round(policy.offload_fraction * tokens)
    return [(n, True) for n in _piece_sizes(stored, chunk)] + [(n, False) for n in _piece_sizes(tokens - stored, chunk)]


def expert_rows(tokens: float, m: ModelConfig, expert: int, skew: float = 1.0, k: int | None = None) -> float:
    """Routed rows the most loaded rank of an expert group receives under expert parallelism: `skew`
    times its uniform share (its tokens' tokens x top_k rows: what every rank gets when routing is
    even), at most what routing allows: every token of the group's `expert` ranks sending it
    min(top_k, experts / expert) rows (one per expert it holds). `k`: experts per token (None: peak_top_k, the
    memory counts' bound; the FLOP counts pass top_k)."""
    k = peak_top_k(m) if k is None else k
    worst = tokens * expert * min(k, m.moe_experts // expert)
    return min(max(skew, 1.0) * tokens * k, worst)


def max_expert_skew(m: ModelConfig, expert: int) -> float:
    """The largest receive skew routing allows at this expert degree (expert_rows' bound over the
    uniform share): expert x min(top_k, experts / expert) / top_k."""
    return expert * min(m.moe_top_k, m.moe_experts // expert) / m.moe_top_k


def expert_parallel_row_bytes(m: ModelConfig, p: int, chunked: bool, c: int | None = None) -> float:
    """Bytes a rank keeps for backward per routed row it receives under expert parallelism
    (parallel/expert/install.py): the received row as the grouped GEMM's input keeps it (`routed_row_bytes`:
    under autocast, c < p, the bf16 casts of w1 and w3) and the experts' SwiGLU intermediates (4 x
    expert_dim, c each), or with memory.expert_chunk, which recomputes them piece by piece, the row itself
    (p d) as the pieces' input; and the two int64 indices that regroup the rows expert-major and back (16).
    Without expert parallelism a rank's own rows keep the first two (moe_ffn_bytes' permute and experts,
    moe_call_terms), so with even routing expert parallelism adds the indices alone."""
    c = p if c is None else c
    rows = p * m.dim if chunked else routed_row_bytes(m, p, c) + 4 * c * m.resolved_expert_dim
    return rows + 16


def experts_copied(m: ModelConfig, calls: list[tuple[int, bool]], expert_chunk: int, expert: int = 1,
                   skew: float = 1.0) -> bool:
    """Whether autocast's bf16 copy of the routed experts' weights outlives the forward (moe_weight_copy_params):
    some stored call runs its experts whole (its rows, or under expert parallelism the rows the rank receives,
    no more than memory.expert_chunk)."""
    def rows(n: int) -> float:
        return expert_rows(n, m, expert, skew) if expert > 1 else n * peak_top_k(m)
    return any(stored and not (expert_chunk and rows(n) > expert_chunk) for n, stored in calls)


def moe_forward_runs(model: ModelConfig, tokens: int, policy: MemoryPolicy) -> float:
    """Forward runs of the MoE feed-forwards in one micro-batch, summed over the MoE layers: 1 each,
    plus the share of its tokens whose call is recomputed in backward (moe_calls: not stored; under
    selective recomputation the feed-forward is recomputed, unless its block is offloaded, where
    the stored offload_fraction of the tokens is not)."""
    if not model.is_moe or tokens <= 0:
        return 0.0
    offloaded = max(0, model.layers - policy.offload_skip_last) if policy.offload_fraction > 0 else 0
    runs = 0.0
    for i in model.moe_layer_ids:
        calls = moe_calls(policy.recompute, i < offloaded, tokens, policy)
        runs += 1 + sum(n for n, stored in calls if not stored) / tokens
    return runs


def moe_call_terms(m: ModelConfig, p: int, calls: list[tuple[int, bool]], expert_chunk: int,
                    offloaded: bool, expert: int = 1, skew: float = 1.0,
                    c: int | None = None, replicas: int = 0, ranks_per_node: int = 0) -> tuple[float, float, float]:
    """(device bytes, host bytes, recomputed FLOPs) a MoE block's feed-forward calls add to its
    per-token count (which holds every stored token's experts' intermediates, `moe_ffn_bytes`):
    each call's `moe_call_bytes` (in an offloaded block its saved tensors' share on the host, the
    router's records on the device); and with memory.expert_chunk, a call of more routed rows (tokens x
    top_k) than that runs its experts in checkpointed pieces: a stored call keeps no intermediates
    (4 x expert_dim per row less) but each piece's int64 group counts [E] (under expert parallelism one per
    `gemm_groups`; on the host in an offloaded block), and every such call runs its experts' w1 and w3 once
    more in backward.

    Under expert parallelism (`expert` > 1) the experts run on the rows the rank receives: on the most
    loaded rank `expert_rows` of them (`skew` x its share); a stored call keeps
    `expert_parallel_row_bytes` for each in place of its own k rows' (on the device: the received
    rows are not the blocks' offloaded tensors).

    `c` (moe_ffn_bytes; under autocast 2): the bytes of the experts' intermediates and permuted rows counted
    there; experts in checkpointed pieces keep each piece's input, the permuted rows in their own dtype (p).
    `replicas` (parallel.expert_replicas, under expert parallelism): each stored call's `copy_slot_bytes` too, and
    its grouped GEMMs' offsets and pieces' counts over the rank's slots (`gemm_groups`). `ranks_per_node`
    (parallel.expert_ranks_per_node): hierarchical dispatch's own saved tensors too (memory/hier_counts.py)."""
    k, groups = peak_top_k(m), gemm_groups(m, expert, replicas)
    hier = hierarchical(expert, ranks_per_node)
    c = p if c is None else c
    device = host = flops = 0.0
    for n, stored in calls:
        rows = received = n * k
        if expert > 1:
            received = expert_rows(n, m, expert, skew)
        chunked = bool(expert_chunk) and received > expert_chunk
        records = moe_call_bytes(m, p, stored=False)  # the router's records stay on the device
        saved = moe_call_bytes(m, p, stored, chunked, c, groups) - records
        if stored:  # (saved tensors, the offloader takes them; the copy slots' and the node exchange's too)
            saved += copy_slot_bytes(m, p, expert, replicas, rows, chunked, c)
            saved += hier_call_bytes(m, c, n, expert, ranks_per_node, skew) if hier else 0.0
        device += records + (0.0 if offloaded else saved)
        host += saved if offloaded else 0.0
        flops += piece_recompute_flops(m, n, expert_chunk, expert, skew)
        if chunked and stored:
            # each piece's counts; no intermediates; the rows as the pieces' input, not as the GEMMs' casts
            kept = (-(-int(received) // expert_chunk) * 8 * groups - rows * 4 * c * m.resolved_expert_dim
                    + rows * (p * m.dim - routed_row_bytes(m, p, c)))
            if offloaded:
                host += kept
            else:
                device += kept
        if expert > 1 and stored:
            # (what this call's own k rows are counted at above: the pieces' input rows, or the GEMMs' casts and
            # the intermediates)
            own = rows * (p * m.dim if chunked else routed_row_bytes(m, p, c) + 4 * c * m.resolved_expert_dim)
            more = received * expert_parallel_row_bytes(m, p, chunked, c) - own
            if offloaded:  # (the offloader takes the block's saved tensors, the received rows' too)
                host += more
            else:
                device += more
    return device + piece_routing_bytes(m, calls), host, flops


def piece_recompute_flops(m: ModelConfig, tokens: int, expert_chunk: int, expert: int = 1, skew: float = 1.0) -> float:
    """FLOPs a call of `tokens` tokens whose experts run in checkpointed pieces (memory.expert_chunk, more routed
    rows than that) runs again in backward: each piece's w1 and w3 (torch._grouped_mm saves w2's inputs before it
    runs, where the piece's recomputation stops: checkpoint's early stop; ops/grouped.py's loop saves after: w2
    too). A time count: at top_k, the run's steady state, not peak_top_k (a DTS-Gate run's first steps route more)."""
    received = expert_rows(tokens, m, expert, skew, m.moe_top_k) if expert > 1 else tokens * m.moe_top_k
    if not expert_chunk or received <= expert_chunk:
        return 0.0
    return received * 4 * m.dim * m.resolved_expert_dim


def piece_routing_bytes(m: ModelConfig, calls: list[tuple[int, bool]]) -> float:
    """Device bytes a MoE block keeps from forward to its backward for routing a call run in pieces
    (memory/apply_policy.py _PieceRouting): where the routing looks across tokens (a capacity, the Sinkhorn
    router's assignment in training: MoEFeedForward.across_tokens) the pieces route with their slice of one
    decision over the whole call, held by the pieces' recomputation: the chosen experts, [T, k] int16 (int32
    past 32,767 experts), and the kept flags, [T, k] bool (with a capacity; the Sinkhorn router's, padding
    masked, counted as a bound). Not a saved tensor, so never offloaded. None for a call of one piece."""
    if len(calls) < 2 or not (m.moe_capacity_factor > 0 or m.moe_router == "sinkhorn"):
        return 0.0
    k = peak_top_k(m)
    chosen = 2 if m.moe_experts <= 32767 else 4
    return float(sum(n for n, _ in calls) * k * (chosen + 1))
