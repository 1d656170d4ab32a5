"""Transient memory: what one rank holds on top of its saved activations while backward runs.

Analytic byte models of the working sets this implementation allocates: one block's backward by
phases (`transient_bytes`; its terms that grow with the block's weights, not its tokens:
memory/weight_grads.py; its attention core's, the document-sparse backward, a chunk pair of the chunked
core (ops/chunked.py) and memory.attention_offload's host memory and traffic: memory/core_transients.py). They
sit beside memory/accounting.py (the saved activations, measured to the byte) and are what the
planner adds to them; benchmarks/block_chunk.py and attention_chunk.py compare them with a step's
measured peak. Shapes are per rank: `head` x `ctx` sequence-parallel ranks (`window`: the
Double-Ring inner ring, 0 = plain ring); all bytes are per rank and micro-batch.
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..config.per_model import per_model
from .accounting import (
    ActivationEstimate,
    estimate_activations,
    layer_activations,
    loss_saved_bytes,
    offloaded_tier_after_post,
)
from .block_parts import block_part_bytes, compute_bytes
from .core_transients import (
    attention_chunks,
    attention_widths,
    chunk_pair_bytes,
    core_working_set_bytes,
    per_chunk_store,
)
from .peak_routing import at_top_k, chunk_fitting_top_ks, peak_top_k
from .policy import MemoryPolicy
from .pre_transients import pre_phase_bytes
from .weight_grads import autocast_weight_bytes, weight_grad_sum_bytes


def ffn_grad_bytes(m: ModelConfig, e: int, moe: bool = False) -> float:
    """Bytes per token of the feed-forward's widest gradients alive at once in its backward: the
    SwiGLU's two of ffn_dim. A MoE feed-forward's (models/moe.py) routed experts, for each of a
    token's k slots, the widest of their backward's phases: the down projection's input gradient
    with the two it makes, the gate and up projections' (three of expert_dim), those two with the
    experts' output gradient (two of expert_dim and one of dim), or the permuted tokens' gradients
    from the two projections and their sum (three of dim); with the routing weights' fp32 gradient
    (4 per slot) and, with shared experts, the input gradient their backward (run first) left for
    the routed one's to add to (d). The shared experts' own backward: the down projection's input
    gradient with the two it makes (three of shared_dim), with their gate the gradient of the shared
    output (d). The larger of the two. (tests/unit/test_memory_transients.py measures it on CPU:
    which phase peaks varies with the incoming gradient and the autograd order; the count is the
    widest, an upper bound.)"""
    if not (moe and m.is_moe):
        return 2 * e * m.ffn_dim
    k, H, d, S = peak_top_k(m), m.resolved_expert_dim, m.dim, m.resolved_shared_dim
    routed = e * k * max(3 * H, 2 * H + d, 3 * d) + 4 * k + (e * d if S else 0)
    shared = 3 * e * S + (e * d if S and m.moe_shared_gate else 0)
    return max(routed, shared)


def ffn_backward_bytes(m: ModelConfig, tokens: int, e: int, moe: bool = False, expert_chunk: int = 0) -> float:
    """Bytes of a feed-forward's backward working set for `tokens` tokens: `ffn_grad_bytes` each,
    unless memory.expert_chunk cuts a MoE layer's routed rows (tokens x top_k) into checkpointed
    pieces. Then the experts' backward runs piece by piece: one piece's recomputed intermediates (4
    x expert_dim per row) and its gradients (as above), but over all rows the experts' output
    gradient, the piece's input gradient made full size (a slice's backward) and their running sum
    (three of dim), and each piece's gradients of the three expert weights [E, hidden, dim] with
    their running sums (five such tensors: an upper bound of what the CPU loop measures)."""
    if not (moe and m.is_moe and expert_chunk and tokens * peak_top_k(m) > expert_chunk):
        return tokens * ffn_grad_bytes(m, e, moe)
    k, H, d, E = peak_top_k(m), m.resolved_expert_dim, m.dim, m.moe_experts
    rows = tokens * k
    routed = rows * (3 * e * d + 4) + expert_chunk * e * (4 * H + max(3 * H, 2 * H + d)) + 5 * e * E * H * d
    shared = tokens * (3 * e * m.resolved_shared_dim + (e * m.dim if m.moe_shared_gate else 0))
    return max(routed, shared)


def piece_tokens(tokens: int, policy: MemoryPolicy) -> tuple[float, float]:
    """(tokens of the largest stored piece, of the largest recomputed piece) of a block's token-wise parts in
    backward (memory/apply_policy.py _in_parts): under selective + offload (an offloaded block) the first A of
    the tokens are stored, their saved tensors in the block's host tier (brought back whole, counted there:
    _block_backward_bytes), and the others recomputed; otherwise every token is recomputed. Each cut by
    block_chunk."""
    stored = tokens * policy.offload_fraction if policy.recompute == "selective" else 0.0
    cut = lambda n: min(policy.block_chunk, n) if policy.block_chunk else n
    return cut(stored), cut(tokens - stored)


def recomputed_piece_bytes(m: ModelConfig, tokens: int, policy: MemoryPolicy, part: dict[str, float],
                           e: int, moe: bool = False) -> float:
    """Bytes of the piece of post (the token-wise parts after the attention core) that backward holds
    at once: under `none` the MLP's two widest gradients over all tokens; recomputed, the piece's saved
    tensors (block_chunk tokens, or all of them) with those gradients; under selective + offload the larger
    of a recomputed piece's and a stored piece's gradients alone (its saved tensors are the block's host tier,
    brought back: counting them here too counted that tier twice, 1.3x to 1.9x the measured peak). Post's
    recomputation saves the MLP norm's tensors, its input h (`residual`, in fp32) and the MLP's intermediates;
    not the block input (the checkpoint's own input, already saved: `norm_input` is pre's) nor the block output
    (non-reentrant checkpointing stops the recomputation once the saved tensors are back). `moe`: a MoE
    layer's block (`part` is then its parts, and the gradients are its feed-forward's, ffn_backward_bytes)."""
    ec = policy.expert_chunk
    if policy.recompute == "none":
        return ffn_backward_bytes(m, tokens, e, moe, ec)

    def piece(n: float, recomputed: bool) -> float:
        post = part["mlp_norm"] + part["residual"] + part["mlp"] if recomputed else 0.0
        if recomputed and moe and m.is_moe and ec and n * peak_top_k(m) > ec:
            post -= 4 * e * peak_top_k(m) * m.resolved_expert_dim  # the experts' intermediates: one piece's (above)
        return n * post + ffn_backward_bytes(m, int(n), e, moe, ec)

    stored, recomputed = piece_tokens(tokens, policy)
    return max(piece(stored, False) if stored else 0.0, piece(recomputed, True) if recomputed else 0.0)


def backward_phase_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, window: int,
                         policy: MemoryPolicy, dtype_bytes: int, docs: bool, moe: bool = False,
                         autocast: bool = False) -> dict[str, float]:
    """{"post", "core", "pre"}: bytes alive on the device in each phase of one block's backward,
    beyond the saved activations and the host tier brought back (see transient_bytes); `moe`: a
    MoE layer's block. `autocast` (bf16 autocast over fp32 weights, dtype_bytes 4): the residual stream's
    gradients (dy, the residual and input gradients being built) and the fp32 accumulators at 4 B, what the
    matmuls and the attention kernel make and their gradients at 2 B (compute_bytes, block_part_bytes' `autocast`)."""
    e = dtype_bytes
    c = compute_bytes(e, autocast)
    t = micro_batch * seq_len // (head * ctx)
    part = block_part_bytes(m, head, e, docs, moe=moe, autocast=autocast)
    q_dim, kv_dim = attention_widths(m, head)
    seq_out = part["attn_out"] if head > 1 else 0.0
    both_layouts = 2 if head > 1 else 1
    chunked = attention_chunks(seq_len, ctx, policy) > 1
    host_chunks = chunked and per_chunk_store(ctx, policy)
    X = e * m.dim
    core_work = core_working_set_bytes(m, head=head, ctx=ctx, window=window, e=c, docs=docs, chunked=chunked,
                                       host_chunks=host_chunks)
    pair = 0.0
    if chunked:
        # a chunk pair holds a chunk of every row of the micro-batch (attention_chunks)
        pair = min(micro_batch * policy.attention_chunk / head, t) * chunk_pair_bytes(m, head, c, docs,
                                                                                   policy.attention_offload)
    full = policy.recompute == "full"
    # the recomputed attention state under full: in post's backward (core state + the output in
    # sequence layout) and in the core's backward (core state); with the per-chunk host store only
    # the output stays on the device
    state_post = (c * q_dim if host_chunks else part["core"] + seq_out) if full else 0.0
    state_core = (0.0 if host_chunks else part["core"]) if full else 0.0
    piece = recomputed_piece_bytes(m, t, policy, part, c, moe)
    # pre's recomputed saved tensors (the attention norm's; with model.qk_norm the q/k norms' too) live
    # until the q/k/v projections' backward: under `full` without block chunks from the block's recompute
    # on (post, core and pre), otherwise for the piece `pre`'s backward recomputes (none: saved
    # activations, counted by memory.accounting). (A stored piece's norm tensors are the block's host tier,
    # brought back.) The pre phase's stages: memory/pre_transients.py
    pre_block = t * (part["norm"] + part["qk_norm"]) if full and not policy.block_chunk else 0.0
    pre = pre_phase_bytes(m, t, pre_pieces(t, policy), part, e=e, c=c, q_dim=q_dim, kv_dim=kv_dim,
                          layouts=both_layouts, autocast=autocast)
    weights = autocast_weight_bytes(m, policy, moe) if autocast else 0.0
    sums = weight_grad_sum_bytes(m, t, policy, 4 if autocast else e, moe)
    freed = t * post_saved_bytes(m, policy, part, seq_out, moe)
    # post's backward over all tokens at once: its MLP's gradients are alive beside dy only (the attention
    # output's gradient and the residual gradient being built come after the MLP's backward, which frees its
    # piece); in pieces, the earlier pieces' attention output and residual gradients are alive beside the next's
    post_work = (max(X + piece / t, 2 * X + c * q_dim) if whole_post_piece(m, t, policy, moe)
                 else 2 * X + c * q_dim + piece / t)
    return {"post": t * (post_work + state_post) + pre_block + weights + sums["post"],
            "core": t * (X + c * q_dim + state_core + core_work) + pair + pre_block + weights - freed,
            "pre": pre + weights + sums["pre"] - t * pre_saved_bytes(m, policy, part, seq_out, moe)}


def pre_pieces(tokens: int, policy: MemoryPolicy) -> list[tuple[float, bool, bool]]:
    """The pieces pre's backward runs in (pre_transients.pre_phase_bytes): (tokens, recomputed in the pre phase,
    its norms' saved tensors on the device then). Under `none` all tokens, nothing recomputed (the norms' tensors
    are saved activations); under `full` without block chunks all tokens, recomputed with the whole block in the
    post phase; otherwise piece_tokens' largest stored piece (its norms' tensors: the host tier) and recomputed
    one."""
    if policy.recompute == "none":
        return [(float(tokens), False, False)]
    if policy.recompute == "full" and not policy.block_chunk:
        return [(float(tokens), False, True)]
    stored, recomputed = piece_tokens(tokens, policy)
    return [piece for piece in ((stored, False, False), (recomputed, True, True)) if piece[0]]


def whole_post_piece(m: ModelConfig, tokens: int, policy: MemoryPolicy, moe: bool = False) -> bool:
    """Whether a dense block's post (output projection, residual, MLP) runs its backward over all `tokens` as one
    piece (nothing recomputed, or one piece of piece_tokens spanning them). Then the MLP's backward, which holds
    its widest gradients (and, recomputed, the piece's saved tensors), runs before the output projection's: by
    the data dependency (the projection's output gradient is the MLP input's, summed with dy), not autograd's
    order, so only the incoming gradient dy is alive beside them. A MoE feed-forward's phases are counted as a
    bound (ffn_grad_bytes): kept whole."""
    if moe and m.is_moe:
        return False
    return policy.recompute == "none" or max(piece_tokens(tokens, policy)) >= tokens


def post_saved_bytes(m: ModelConfig, policy: MemoryPolicy, part: dict[str, float], seq_out: float,
                     moe: bool = False) -> float:
    """Bytes per token of a block's own saved activations that its core phase no longer holds: under `none`
    what post's nodes alone saved, the MLP norm's tensors, its input h, the MLP's intermediates (memory.accounting
    _kept_block) and, with the all-to-all, the attention output in sequence layout (the output projection's
    input). A node's saved tensors are freed when it has run, and the core's backward runs only once every node
    reading its output has (post's): by the data dependency, not autograd's order. Counted on top of all the
    saved activations, `none` was 1.65x to 1.97x the measured transient (tests/unit/test_transient_tightening.py).
    Other policies save none of post's tensors on the device (recomputed, or the host tier's, freed by phase
    apart: offloaded_tier_after_post). A MoE block's feed-forward count (moe_ffn_bytes) is an upper bound: not
    credited. The pre phase credits these and the core's saved state (pre_saved_bytes)."""
    if policy.recompute != "none" or (moe and m.is_moe):
        return 0.0
    return part["mlp_norm"] + part["residual"] + part["mlp"] + seq_out


def pre_saved_bytes(m: ModelConfig, policy: MemoryPolicy, part: dict[str, float], seq_out: float,
                    moe: bool = False) -> float:
    """Bytes per token of a block's own saved activations that its pre phase no longer holds: post's
    (post_saved_bytes) and, on the device under `none` and selective (not an offloaded block: its state is the host
    tier, freed by phase apart in _block_backward_bytes; nor with memory.attention_offload: the host's), the
    attention core's saved state (q, k, v, out, lse) with, under selective and the all-to-all, the attention output
    in sequence layout (post's checkpoint input). The core's backward node frees them once it has run, and pre's
    backward needs the gradients it makes: by the data dependency, not autograd's order."""
    freed = post_saved_bytes(m, policy, part, seq_out, moe)
    offloaded = policy.recompute == "selective" and policy.offload_fraction
    if policy.recompute == "full" or offloaded or policy.attention_offloaded:
        return freed
    return freed + part["core"] + (seq_out if policy.recompute == "selective" else 0.0)


def lm_head_bytes(m: ModelConfig, tokens: int, loss_chunk: int, e: int, autocast: bool = False) -> float:
    """The LM head's backward (ops/loss.py). Chunked: one chunk's logits made in the compute dtype and
    their fp32 copy, which becomes their gradient in place, then its copy in the compute dtype (e + 4 B
    per element: fp32 makes them in place, 4; `autocast`, bf16 autocast over fp32 weights counted at e = 4,
    makes bf16 logits: 2 + 4), the chunk's recomputed final norm and its per-row scalars (labels clamped to
    int64, the fp32 scale and one-hot values: 16 B), and the hidden-state gradient the backward fills for
    all `tokens` (e x dim, alive from its start: fp32 under autocast, the residual stream's). Unchunked:
    cross_entropy's backward holds two fp32 [tokens, vocab] gradients at once (nll's and log-softmax's), 8 B
    per element whatever the dtype. Under autocast a chunked loss also casts the head weight to bf16 afresh in
    backward (2 B per element); the plain loss's copy is one its forward saved, counted with the saved
    activations (accounting.py head_weight_copy_bytes), not again here.
    (Measured: tests/unit/test_peaks_audit_lm_head.py, test_autocast_transients.py; the head's fp32 weight
    gradient is the model states'.)"""
    # autocast: the head weight's bf16 copy for the chunks' matmuls (2 B per element)
    weight = 2 * m.vocab_size * m.dim if autocast else 0
    if loss_chunk and tokens > loss_chunk:
        norm = block_part_bytes(m, 1, e)["norm"]
        # the final norm's backward over the chunk (ops/norm.py rms_norm, statistics in fp32): the output
        # gradient's fp32 copy, its products with the rsqrt and with the fp32 input, the mean's expanded
        # gradient, pow's input and its two products: six fp32 [chunk, dim] at once, measured in a bf16 model
        # (vocabulary 320: uncounted, the transient was 0.67x the measured one, the LM head's backward its peak;
        # tests/unit/test_activation_peak_estimate.py). It needs the hidden-state gradient, which the head's
        # matmul backward makes from the logits' gradient (a data dependency): by then only the logits' copy in
        # the compute dtype is alive, their fp32 gradient freed (measured). The larger of the two stages
        c = compute_bytes(e, autocast)
        logits = m.vocab_size * (c + 4)
        norm_backward = m.vocab_size * c + 6 * 4 * m.dim
        return loss_chunk * (max(logits, norm_backward) + norm + 16) + tokens * e * m.dim + weight
    return tokens * m.vocab_size * 8


def transient_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, window: int = 0,
                    policy: MemoryPolicy, dtype_bytes: int, docs: bool,
                    acts: ActivationEstimate | None = None, autocast: bool = False, head_grad: float = 0.0) -> float:
    """Peak bytes on top of the saved activations (memory.accounting): the larger of the LM head's
    backward (and `head_grad`, bytes held in that phase alone: costs/host_bytes.py head_grad_bytes) and one
    block's backward, the latter less what the loss's backward freed before it
    (`loss_saved_bytes`: the final norm's and the loss's saved tensors, the last block's output they
    held; with an unchunked loss over a large vocabulary 4 x vocab bytes per token, once counted twice
    at the block's peak). Its phases: block_after_loss_bytes.

    Not modelled: the attention kernel's own workspace. On CPU, glibc keeps freed heap memory
    mapped (its mmap threshold grows with the largest freed block), so a process's RSS can exceed
    the live bytes by ~2x; benchmarks compare with MALLOC_MMAP_THRESHOLD_ fixed (docs/benchmarks.md).

    The LM head holds one chunk of logits in the compute dtype and in fp32 and the hidden-state gradient
    (unchunked: two fp32 gradients of all the logits; `lm_head_bytes`). Model-wise
    estimates of the allocator's behaviour; the saved activations are the exact part.

    `autocast`: one process in bf16 autocast over fp32 weights (memory/accounting.py activation_dtype: (4,
    True), dtype_bytes 4). Each tensor is then counted at the dtype it has: the residual stream (block
    inputs and outputs, dy and the residual / input gradients being built), the norms' statistics and
    outputs, the fp32 dq / dk / dv accumulators, the log-sum-exp and the logits' fp32 copy at 4 B; the
    matmuls' and the attention kernel's outputs (q, k, v, the attention output, the MLP's intermediates, a
    chunk of logits), their gradients and the kernel's gradients and GQA repeats at 2 B (compute_bytes).
    Without it, fp32 (4) and FSDP's bf16 (2) runs count every tensor at dtype_bytes as before.
    (tests/unit/test_autocast_transients.py measures the step's peak on CPU.)

    A DTS-Gate model is counted at memory/peak_routing.py peak_top_k, and where memory.expert_chunk makes a step
    of fewer experts per token hold more (chunk_fitting_top_ks: its calls' experts run whole), the largest."""
    t = micro_batch * seq_len // (head * ctx)
    sizes = sorted({t, *(n for n in piece_tokens(t, policy) if n)})
    ks = chunk_fitting_top_ks(m, policy.expert_chunk, lambda k: [n * k for n in sizes])
    return max(_transient_at(mk, seq_len, micro_batch, head=head, ctx=ctx, window=window, policy=policy,
                             dtype_bytes=dtype_bytes, docs=docs, acts=acts, autocast=autocast, head_grad=head_grad)
               for mk in (m, *(at_top_k(m, k) for k in ks)))


def _transient_at(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, window: int,
                  policy: MemoryPolicy, dtype_bytes: int, docs: bool, acts: ActivationEstimate | None,
                  autocast: bool, head_grad: float) -> float:
    """transient_bytes at the model's peak_top_k."""
    e = dtype_bytes
    t = micro_batch * seq_len // (head * ctx)
    block = block_after_loss_bytes(m, seq_len, micro_batch, head=head, ctx=ctx, window=window, policy=policy,
                                   dtype_bytes=e, docs=docs, acts=acts, autocast=autocast)
    # + the backward's seed, ones_like(loss): one fp32 scalar, alive throughout (the post phase over all tokens
    # is counted to the byte: without it, 4 B under the measured peak in fp32)
    return max(block, lm_head_bytes(m, t, policy.loss_chunk, e, autocast) + head_grad) + 4


def block_after_loss_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, window: int,
                           policy: MemoryPolicy, dtype_bytes: int, docs: bool, acts: ActivationEstimate | None,
                           autocast: bool = False) -> float:
    """transient_bytes' block term: the largest block backward's bytes beyond the saved activations
    (_block_backward_bytes), less what the loss's backward freed before it (loss_saved_bytes). A block's
    backward runs in phases, and what is alive in each follows the implementation (autograd frees a gradient
    once its consumer has run):

    - what comes back from the host under offload: the block's host tier (under selective whole in
      `post`, then what the core's and pre's backward still read: accounting.offloaded_tier_after_post);
      the next block's (prefetched one block ahead) comes back in the `pre` phase only, under full and
      selective alike (memory/offload.py prefetch_mark);
    - `post` backward (output projection, residual, MLP, in pieces of `block_chunk` tokens, or all
      tokens): the incoming gradient dy and the residual gradient being built (two of d), the
      attention output's gradient (sequence layout), one piece recomputed with the gradients of its
      widest intermediates (the MLP's, or a MoE feed-forward's: `ffn_backward_bytes`), and under `full`
      the recomputed attention state (q, k, v, output, log-sum-exp in the core's layout, and the
      output in sequence layout); of a MoE model, the larger of its MoE and its dense blocks. Over all
      tokens in one piece (whole_post_piece), the MLP's backward (dy beside it) and the output
      projection's (the two of d and the attention output's gradient) are the larger of two stages;
    - under `none`, the core's phase without what post's nodes saved (post_saved_bytes);
    - the core's backward: the residual gradient, the attention output's gradient (core layout),
      under `full` the recomputed state, and the core's working set: fp32 dq and dk/dv
      accumulators over all tokens (a ring adds the dk/dv block in flight and the K/V block
      received, two under Double-Ring), and unchunked, k and v repeated to every query head with
      their gradients (grouped-query attention) and with documents the document-sparse backward of
      one call (`sparse_attention_backward_bytes`: linear in the tokens, no S^2 term). With
      memory.attention_chunk (ops/chunked.py) the repeat and the sparse temporaries are one chunk
      pair's (`chunk_pair_bytes` for chunk / head rank tokens); with attention_offload and no ring
      the state comes back one chunk at a time and dq accumulates on the host, so only the
      returned dq, dk, dv span all tokens;
    - `pre` backward, by stages (memory/pre_transients.py pre_phase_bytes): the residual gradient, dq, dk, dv
      in the sequence layout (and, under the all-to-all, its head-layout copy), beside the recomputation of a
      piece of pre (its norms' saved tensors, its projections' outputs, RoPE's forward in fp32), RoPE's
      backward (in fp32), the projections' input gradients summed, or the attention norm's fp32 backward (not
      post's piece: the MLP's intermediates and gradients are gone by then); less what the block saved that
      the phases before it freed (pre_saved_bytes: the core's state, post's tensors). An offloaded block's
      phases hold none of the kept blocks' saved activations (kept_blocks_freed_bytes)."""
    e = dtype_bytes
    block = _block_backward_bytes(m, seq_len, micro_batch, head=head, ctx=ctx, window=window, policy=policy,
                                  e=e, docs=docs, acts=acts, autocast=autocast)
    # a block's backward runs after the loss's: what the final norm and the loss saved is freed by then
    freed = loss_saved_bytes(m, seq_len, micro_batch, head=head, ctx=ctx, policy=policy, dtype_bytes=e,
                             autocast=autocast)
    return block - freed


def _block_backward_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int, window: int,
                          policy: MemoryPolicy, e: int, docs: bool, acts: ActivationEstimate | None,
                          autocast: bool = False) -> float:
    """The largest block backward's bytes beyond the saved activations (transient_bytes). Under offload
    the blocks differ: an offloaded block's backward holds its host tier brought back (under full: its
    input made whole again instead) and, in its pre phase only, the next one's (prefetched:
    memory/offload.py prefetch_mark), and under selective recomputes 1 - A of its tokens (piece_tokens); a
    kept block (the last offload_skip_last) recomputes all its tokens, with the offloaded block before it
    prefetched in its pre phase. A MoE model's MoE and dense blocks differ too: the largest of the kinds
    among the offloaded blocks, and among the kept ones."""
    sparse = set(m.moe_layer_ids)
    offloaded = max(0, m.layers - policy.offload_skip_last) if policy.offload_fraction else 0

    def phases(pol: MemoryPolicy, extra: dict[str, float] | None = None, blocks: range = range(m.layers)) -> float:
        """The largest phase of the backward of the `blocks` (their kinds: MoE, dense), `extra[phase]` more bytes
        held in that phase."""
        extra = extra or {}
        return max(max(v + extra.get(k, 0.0) for k, v in _phase_items(
            m, seq_len, micro_batch, head, ctx, window, pol, e, docs, moe, autocast))
            for moe in {i in sparse for i in blocks} or {False})

    if not offloaded:  # (every block kept, offload_skip_last >= layers: each recomputes all its tokens)
        return phases(dataclasses.replace(policy, offload_fraction=0.0))
    acts = acts or estimate_activations(m, seq_len, micro_batch, head=head, ctx=ctx, policy=policy,
                                        dtype_bytes=e, docs=docs, autocast=autocast)
    before = {"pre": acts.per_block_host}
    # each kind of block counted by the blocks of it: the offloaded are the first `offloaded`, the kept the rest
    # (apply_policy.py). Counted over every block, a MoE model whose offloaded blocks are dense (debug-moe, its
    # MoE block kept) had its offloaded count take a MoE block's post phase with the host tier beside it: 1.30x the
    # measured transient with shared experts, 1.21x now (tests/unit/test_leftovers119_moecount.py)
    kept = phases(dataclasses.replace(policy, offload_fraction=0.0), before, range(offloaded, m.layers))
    # the first block has no block before it to prefetch: with one offloaded block (the first) its pre phase
    # brings nothing back (a kept block's count, `kept`, holds the one prefetch of the last offloaded block)
    prefetched = acts.per_block_host if offloaded > 1 else 0.0
    if policy.recompute == "full":
        # the block input's host part comes back and is joined with its device rest into a whole new
        # tensor (memory/offload.py _unpack: torch.cat), the recompute's input for the block's whole
        # backward; the part brought back is freed once joined. The block before's part comes back in
        # the pre phase only (prefetch_mark: after the attention core's backward), in the offloaded
        # blocks' and the first kept one's backward alike
        own = micro_batch * seq_len // (head * ctx) * e * m.dim
        off = own + phases(policy, {"pre": prefetched}, range(offloaded))
    else:  # its own host tier brought back (prefetched whole, in the pre phase of the block after it): whole
        # in its post phase, then only what the core's and pre's backward still read (each part is freed with
        # the backward that reads it); the block before's whole in the pre phase (prefetch_mark: after the
        # attention core's backward). Counted whole in every phase, it was counted twice in pre (1.3x to 1.9x
        # the measured peak: tests/unit/test_selective_offload_peak.py)
        t = micro_batch * seq_len // (head * ctx)
        pre, core = offloaded_tier_after_post(block_part_bytes(m, head, e, docs, autocast=autocast), e, m.dim,
                                              float(policy.offload_fraction))
        off = phases(policy, {"post": acts.per_block_host, "core": t * (pre + core),
                              "pre": t * pre + prefetched}, range(offloaded))
    if offloaded < m.layers:
        off -= kept_blocks_freed_bytes(m, seq_len, micro_batch, head=head, ctx=ctx, policy=policy, e=e, docs=docs,
                                       autocast=autocast)
    return off if offloaded == m.layers else max(off, kept)


@per_model
def _phase_items(m: ModelConfig, seq_len: int, micro_batch: int, head: int, ctx: int, window: int,
                 policy: MemoryPolicy, dtype_bytes: int, docs: bool, moe: bool, autocast: bool) -> tuple:
    """backward_phase_bytes' items in its order, kept per model config object and every other argument
    (config/per_model.py: a config is not changed once built): the planner's search asks for the same block's
    phases for every expert degree, skew and copy slots of a layout (none of which they read) and for the policies
    whose kept blocks are alike (qwen3-30b-a3b on 16 GPUs at 32K: 40,176 asks, 12,152 distinct; docs/planner.md
    "How the search is timed"). A tuple: no caller can change what is kept."""
    return tuple(backward_phase_bytes(m, seq_len, micro_batch, head=head, ctx=ctx, window=window, policy=policy,
                                      dtype_bytes=dtype_bytes, docs=docs, moe=moe, autocast=autocast).items())


def kept_blocks_freed_bytes(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int,
                            policy: MemoryPolicy, e: int, docs: bool, autocast: bool = False) -> float:
    """Device bytes of the kept blocks' (the last offload_skip_last) saved activations, all freed before any
    offloaded block's backward starts: a kept block's saved tensors are read by nodes on the path to its input's
    gradient (its core, its norms', its matmuls'), which the blocks before it need first (a data dependency, not
    autograd's order), and each node frees what it saved once it has run. Less each kept block's output (the
    next block's input, or the one the loss's backward freed: loss_saved_bytes credits that one) and never below
    0: under `full` a kept block keeps its input alone, credited nothing. Under selective the kept blocks' core
    state (and the attention output in sequence layout): without this, the offloaded blocks' count held them
    beside the host tier brought back (measured: tests/unit/test_transient_tightening.py skip-1 cases)."""
    # (a MoE block's saved count depends on the expert layout and routing, counted here without them: not credited;
    # where every kept block is a MoE one, as in most MoE models, nothing is, and the layers need no count: the
    # planner asks this for every offloading candidate)
    kept = range(max(0, m.layers - policy.offload_skip_last) if policy.offload_fraction else 0, m.layers)
    if set(kept) <= set(m.moe_layer_ids):
        return 0.0
    t = micro_batch * seq_len // (head * ctx)
    layers = layer_activations(m, seq_len, micro_batch, head=head, ctx=ctx, policy=policy, dtype_bytes=e,
                               docs=docs, autocast=autocast)
    out = lambda la: t * block_part_bytes(m, head, e, docs, moe=la.moe, autocast=autocast)["block_out"]
    return sum(max(la.device - out(la), 0.0) for la in layers if not la.offloaded and not la.moe)
