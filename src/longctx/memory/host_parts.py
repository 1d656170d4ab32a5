"""The offloaded activations one allocation at a time: what the host tier holds, part by part.

memory/accounting.py counts the host tier in bytes per token; on CUDA each part the offloader
(memory/offload.py) or the attention core's ChunkStore (ops/chunked.py) moves to the host is one
pinned request, which torch's caching host allocator locks rounded up to a power of two
(ops/pinned.py): a [74752, 4096] bf16 part is 612 MB and locks 1 GiB. So the locked figure needs the
parts themselves, listed here from the same graph (every size in bytes, per rank and micro-batch):

- `full` + offload_fraction A: the block input, the first round(A x elements) of it (one part).
- `selective` + A, an offloaded block (memory/apply_policy.py `_offload_forward`, everything saved goes
  to the host whole): the block runs in pieces (the first round(A x tokens) tokens stored, the rest
  recomputed, each cut by block_chunk); a stored piece of t tokens keeps its norms' tensors (fp32: the
  input, the normed x, the output and the rsqrt per token; bf16: the input's fp32 copy instead of the
  input; bf16 autocast over fp32 weights: the fp32 input, normed x and rsqrt, and instead of the output the
  bf16 cast each matmul it feeds makes, three for the attention norm and two for the MLP norm), the q/k
  norms', the residual h (fp32), the four SwiGLU tensors; a recomputed piece its input slice (its
  checkpoint's); each piece its slice of the attention output in sequence layout when that is a tensor of
  its own (head > 1, or the core's state offloaded); the core its q, k, v, out, lse whole. Under autocast
  what the matmuls and the attention kernel make (q, k, v, out, the attention output, the SwiGLU tensors)
  is bf16 and the residual stream fp32 (memory/block_parts.py block_part_bytes' `autocast`, compute_bytes).
- memory.attention_offload: the core's state by chunk (ChunkStore: k, v per key chunk, q, out, lse per
  query chunk over the core's sequence, batch included; a ring's five tensors whole); under `full` the
  recomputed block's, with dout and the fp32 dq per chunk (memory/transients.py).

A MoE feed-forward's saved tensors (moe_counts) are not listed: its host bytes are counted twice over, the
most a power-of-two rounding can take (pinned_activation_bytes). tests/unit/test_host_parts.py holds the
lists against the allocations the real offloader makes on CPU (tests/distributed/test_host_parts_layouts.py
under head 2 and ctx 2).
"""

from __future__ import annotations

from collections import Counter

from ..config import ModelConfig
from ..ops.chunked import chunk_slices
from ..ops.pinned import pinned_bytes
from .accounting import layer_activations, peak_models
from .block_parts import ATTENTION_NORM_FEEDS, MLP_NORM_FEEDS, compute_bytes
from .layer_hosts import layers_key, recall, remember
from .policy import MemoryPolicy


def _pieces(tokens: int, stored: int, chunk: int) -> tuple[list[int], list[int]]:
    """(stored pieces, recomputed pieces) in tokens, as apply_policy._in_parts cuts them."""
    cut = min(stored, tokens)
    cuts = lambda n: [sl.stop - sl.start for sl in chunk_slices(n, chunk)] if n > 0 else []
    return cuts(cut), cuts(tokens - cut)


def _norm_parts(width: int, rows: int, t: int, p: int) -> list[int]:
    """ops/norm.py rms_norm over t tokens of `width` elements in `p`-byte values (`rows` statistics each): the
    rsqrt per row, the normed values in the input's dtype, its fp32 copy of a bf16 input (an fp32 input is
    saved as itself: the caller counts it)."""
    return [4 * rows * t, p * width * t] + ([4 * width * t] if p != 4 else [])


def _norm_output_parts(d: int, t: int, p: int, c: int, feeds: int) -> list[int]:
    """What a block norm's output leaves saved, the next linears' input: the output itself, or under autocast
    (c < p) the bf16 cast that each of the `feeds` matmuls it feeds makes of it."""
    return [c * d * t] * feeds if c < p else [p * d * t]


def _stored_piece_parts(m: ModelConfig, t: int, p: int, c: int) -> list[int]:
    """A stored piece's token-wise tensors but the SwiGLU's: its input (fp32: the norm's), both block norms,
    the q/k norms (of the projections, in the matmuls' dtype c; in fp32 the projections themselves are their
    inputs), the residual h (fp32)."""
    d, hd, H, K = m.dim, m.resolved_head_dim, m.heads, m.kv_heads
    own = [p * d * t, p * d * t] if p == 4 else []                  # the piece's input, h (the norms' inputs)
    parts = own + [x for feeds in (ATTENTION_NORM_FEEDS, MLP_NORM_FEEDS)
                   for x in _norm_parts(d, 1, t, p) + _norm_output_parts(d, t, p, c, feeds)]
    if m.qk_norm:
        every = getattr(m, "qk_norm_span", "head") == "all"
        for width, rows in ((H * hd, 1 if every else H), (K * hd, 1 if every else K)):
            parts += _norm_parts(width, rows, t, c) + ([4 * width * t] if c == 4 else [])
    return parts


def _mlp_parts(m: ModelConfig, t: int, c: int) -> list[int]:
    return [c * m.ffn_dim * t] * 4                                 # w1 out, silu out, w3 out, product


def _chunk_lens(seq_len: int, ctx: int, policy: MemoryPolicy) -> list[int]:
    return [sl.stop - sl.start for sl in chunk_slices(seq_len // ctx, policy.attention_chunk)]


def core_parts(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, policy: MemoryPolicy,
               p: int) -> list[int]:
    """The attention core's saved q, k, v, out, lse as host allocations: whole (autograd's, a ring's store)
    or, under attention_offload without a ring, the ChunkStore's chunk by chunk (over the core's sequence,
    the batch in each chunk)."""
    hd, b = m.resolved_head_dim, micro_batch
    hl, kl = m.heads // head, max(m.kv_heads, head) // head
    if not (policy.attention_offloaded and ctx == 1):
        n = b * seq_len // ctx  # the core's tokens (head layout), local heads
        return [p * n * hl * hd, p * n * kl * hd, p * n * kl * hd, p * n * hl * hd, 4 * n * hl]
    lens = _chunk_lens(seq_len, ctx, policy)
    parts = [p * b * L * kl * hd for L in lens for _ in range(2)]  # k, v
    parts += [p * b * L * hl * hd for L in lens]                   # q
    return parts + [x for L in lens for x in (p * b * L * hl * hd, 4 * b * hl * L)]  # out, lse


def _gradient_chunk_parts(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int,
                          policy: MemoryPolicy, p: int) -> list[int]:
    """What a chunked store adds in a block's backward: dout and the fp32 dq accumulator per query chunk."""
    if not (policy.attention_offloaded and ctx == 1):
        return []
    width = micro_batch * m.heads // head * m.resolved_head_dim
    return [x for L in _chunk_lens(seq_len, ctx, policy) for x in (p * L * width, 4 * L * width)]


def offloaded_block_parts(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int,
                          policy: MemoryPolicy, p: int, mlp: bool = True, autocast: bool = False) -> list[int]:
    """Each host allocation of one offloaded block (the module's docstring); `mlp`: with the dense SwiGLU's;
    `autocast`: bf16 autocast over fp32 weights (p = 4: memory/accounting.py activation_dtype)."""
    n = micro_batch * seq_len // (head * ctx)
    A = float(policy.offload_fraction)
    c = compute_bytes(p, autocast)
    if policy.recompute == "full":
        cut = round(A * n * m.dim)
        return [p * cut] if cut else []
    stored, recomputed = _pieces(n, round(A * n), policy.block_chunk)
    seq_out = head > 1 or policy.attention_offloaded
    parts: list[int] = []
    for t in stored:
        parts += _stored_piece_parts(m, t, p, c) + (_mlp_parts(m, t, c) if mlp else [])
    parts += [p * m.dim * t for t in recomputed]                   # the checkpoints' inputs
    if seq_out:
        parts += [c * m.heads * m.resolved_head_dim * t for t in stored + recomputed]
    return parts + core_parts(m, seq_len, micro_batch, head=head, ctx=ctx, policy=policy, p=c)


# (a block's parts, locked and exact bytes) by everything they depend on: the planner asks for the same ones
# again and again (3,702 distinct of 23,090 asked for an 8B plan on 8 GPUs, a third of its search time)
_KINDS: dict[tuple, tuple[int, int]] = {}


def pinned_activation_bytes(m: ModelConfig, seq_len: int, micro_batch: int = 1, *, head: int = 1, ctx: int = 1,
                            policy: MemoryPolicy, dtype_bytes: int, docs: bool = False, expert: int = 1,
                            expert_skew: float = 1.0, autocast: bool = False, expert_replicas: int = 0,
                            expert_ranks_per_node: int = 0) -> float:
    """estimate_activations' total_host as torch's host allocator pins it on CUDA: each part rounded up to
    a power of two. A MoE block's feed-forward (not listed, FlexMoE's copy slots included) at twice its bytes: the
    bound of the rounding.
    `autocast`: bf16 autocast over fp32 weights (dtype_bytes 4), each part at its own dtype (as estimate_activations
    counts them). A DTS-Gate model: the largest over accounting.peak_models, as estimate_activations."""
    kw = dict(head=head, ctx=ctx, policy=policy, dtype_bytes=dtype_bytes, docs=docs, expert=expert,
              expert_skew=expert_skew, autocast=autocast, expert_replicas=expert_replicas,
              expert_ranks_per_node=expert_ranks_per_node)
    models = peak_models(m, micro_batch * seq_len // (head * ctx), policy, expert, expert_skew)
    return max(_pinned_at(mk, seq_len, micro_batch, **kw) for mk in models)


def _pinned_at(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, policy: MemoryPolicy,
               dtype_bytes: int, docs: bool, expert: int, expert_skew: float, autocast: bool, expert_replicas: int,
               expert_ranks_per_node: int) -> float:
    """pinned_activation_bytes at the model's peak_top_k."""
    p, rc = dtype_bytes, policy.recompute
    kw = {"head": head, "ctx": ctx, "policy": policy}
    model = repr(m)  # (every field: whatever the parts read of it)
    # this call's kinds by (offloaded, moe): every other field of _KINDS' key is this call's, so a MoE model's
    # layers (48 of qwen3-30b-a3b) look their kind up in a dict of at most four, not by hashing the whole key
    # (its model repr and policy) once per layer, a tenth of a MoE search's time (docs/planner.md)
    seen: dict[tuple[bool, bool], tuple[int, int]] = {}

    def kind(offloaded: bool, moe: bool) -> tuple[int, int]:
        hit = seen.get((offloaded, moe))
        if hit is None:
            hit = seen[offloaded, moe] = _kind(offloaded, moe)
        return hit

    def _kind(offloaded: bool, moe: bool) -> tuple[int, int]:
        key = (model, seq_len, micro_batch, head, ctx, policy, p, autocast, offloaded, moe)
        if key not in _KINDS:
            if offloaded:
                parts = offloaded_block_parts(m, seq_len, micro_batch, mlp=not moe, p=p, autocast=autocast, **kw)
            elif policy.attention_offloaded and rc in ("selective", "none"):
                parts = core_parts(m, seq_len, micro_batch, p=compute_bytes(p, autocast), **kw)
            else:
                parts = []
            if len(_KINDS) >= 65536:
                _KINDS.clear()
            _KINDS[key] = (locked_bytes(parts), sum(parts))
        return _KINDS[key]

    if not m.is_moe:  # every block alike but for being offloaded (the first layers - offload_skip_last)
        off = max(0, m.layers - policy.offload_skip_last) if policy.offload_fraction > 0 else 0
        return float(off * kind(True, False)[0] + (m.layers - off) * kind(False, False)[0])
    moe_kw = dict(expert=expert, expert_skew=expert_skew, autocast=autocast, expert_replicas=expert_replicas,
                  expert_ranks_per_node=expert_ranks_per_node)
    key = layers_key(model, seq_len, micro_batch, head, ctx, policy, p, docs, **moe_kw)
    blocks = recall(key) or remember(key, layer_activations(m, seq_len, micro_batch, head=head, ctx=ctx,
                                                            policy=policy, dtype_bytes=p, docs=docs, **moe_kw))
    total = 0.0
    for offloaded, moe, host in blocks:
        locked, exact = kind(offloaded, moe)
        total += locked
        if moe:  # the feed-forward's parts, unlisted: at most twice their bytes once rounded
            total += 2 * max(0.0, host - exact)
    return total


def locked_bytes(parts: list[int]) -> int:
    """What pinning each of `parts` by itself locks (ops/pinned.py pinned_bytes, once per distinct size)."""
    return sum(pinned_bytes(size) * n for size, n in Counter(parts).items())


def pinned_attention_offload_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int,
                                   policy: MemoryPolicy, dtype_bytes: int) -> float:
    """memory/core_transients.py attention_offload_host_and_traffic's host bytes as pinned on CUDA, each part
    rounded up: the backward's dout and fp32 dq per chunk of a chunked store, and under `full` the
    recomputed block's core state."""
    if not policy.attention_offloaded:
        return 0.0
    kw = {"head": head, "ctx": ctx, "policy": policy, "p": dtype_bytes}
    parts = _gradient_chunk_parts(m, seq_len, micro_batch, **kw)
    if policy.recompute == "full":
        parts += core_parts(m, seq_len, micro_batch, **kw)
    return float(locked_bytes(parts))
