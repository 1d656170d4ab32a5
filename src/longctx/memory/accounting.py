"""Activation memory: what each policy is expected to keep (analytic) and what it keeps (measured).

Analytic: `estimate_activations` counts, per rank, the bytes every block leaves for backward under
a policy, from the model shape and the layout. The count follows this implementation's graph
(which tensors autograd saves: RMSNorm's fp32 statistics, RoPE outputs, the attention core's
q/k/v/out/log-sum-exp in its head layout, the SwiGLU intermediates...), so measurement can check it
to the byte; it is also printed beside the published per-layer formulas (Korthikanti et al.'s
34 s b h with FlashAttention, MEMO's 16 s b h skeletal activations), which count 16-bit GPT-style
layers and so differ from ours by design. The bytes per token of each tensor a block can keep are
memory/block_parts.py's.

Measured: memory/measured.py `measure_activations` (a dispatch mode that records the storages each
block's forward leaves for backward, device and host tier); on GPU the benchmark also reports the
allocator's peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..models.flops import attention_matmul_params, dense_ffn_params, matmul_params_per_layer, moe_ffn_params
from .block_parts import autocast_norm_bytes, block_part_bytes, compute_bytes
from .layer_hosts import layers_key, remember
from .moe_counts import expert_rows, experts_copied, moe_call_terms, moe_calls, moe_weight_copy_params
from .peak_routing import at_top_k, chunk_fitting_top_ks
from .policy import MemoryPolicy

NO_POLICY = MemoryPolicy()  # nothing recomputed, offloaded or chunked

# ------------------------------------------------------------------------------------------------
# Analytic


@dataclass
class ActivationEstimate:
    """Bytes per rank for one micro-batch (all sequences on the rank)."""
    per_block_device: float    # an offloaded block (or any block when nothing is offloaded)
    per_block_host: float      # an offloaded block's host-tier bytes
    kept_block_device: float   # a block among the last `offload_skip_last` (never offloaded)
    model_device: float        # outside the blocks: embeddings output, RoPE tables, final norm, loss
    total_device: float
    total_host: float
    recompute_flops: float     # forward FLOPs re-run in backward, per micro-batch (as eager checkpointing runs them)
    tokens: int                # tokens on the rank (micro_batch x seq / (head x ctx))

    def to_dict(self) -> dict:
        return asdict(self)


def _flops_per_token(m: ModelConfig, seq_len: int, moe: bool = False, expert: int = 1) -> dict[str, float]:
    d, hd, H, K = m.dim, m.resolved_head_dim, m.heads, m.kv_heads
    ffn = moe_ffn_params(m, active=True) if moe and m.is_moe else dense_ffn_params(m)
    return {
        "pre": 2 * d * (H + 2 * K) * hd,
        "post": 2 * H * hd * d + 2 * ffn,
        "attention": 2 * seq_len * H * hd,  # 4 s H hd, halved by the causal mask
        "unsaved_tail": _unsaved_tail_flops(m, moe, expert),
    }


def _unsaved_tail_flops(m: ModelConfig, moe: bool, expert: int) -> float:
    """FLOPs per token of `post`'s last matmul, whose output no later op saves. Autograd saves a matmul's
    inputs before it runs, and torch's non-reentrant checkpoint stops a recomputation at the last save its
    backward needs (its early stop): that matmul never runs again (FlopCounterMode on real backwards:
    tests/unit/test_flops_audit2_recompute.py). A dense SwiGLU's down projection w2; in a MoE layer the
    ungated shared experts' (run after the combine; a gate's product saves their output). Under expert
    parallelism they run beside the rows' way back, before the combine, whose weighting saves the routed
    experts' outputs: none (a pipelined dispatch runs them after: re-run less than counted)."""
    if not (moe and m.is_moe):
        return 2 * m.dim * m.ffn_dim
    if m.resolved_shared_dim and not m.moe_shared_gate and expert == 1:
        return 2 * m.dim * m.resolved_shared_dim
    return 0.0


def _kept_block(recompute: str, part: dict[str, float], fl: dict[str, float], seq_out: float, core_device: float,
                chunks: int) -> tuple[float, float]:
    """(bytes, recomputed FLOPs) per token of a block that stays on the device under `recompute`, its token-wise
    parts in `chunks` pieces (memory.block_chunk; 1: none). Recomputed: what eager checkpointing re-runs,
    `pre` and `post` but the unsaved tail (_unsaved_tail_flops)."""
    if recompute == "none":
        kept = (part["norm"] + part["mlp_norm"] + part["qk_norm"] + core_device + seq_out + part["residual"]
                + part["mlp"] + part["block_out"])
        return kept, 0.0
    token_wise = fl["pre"] + fl["post"] - fl["unsaved_tail"]
    if recompute == "full":
        # the block keeps its input (the previous block's output); with chunks nested in the block's
        # checkpoint the token-wise parts run once more: the chunks' checkpoints re-run them (less the
        # tail), and the block's own recomputation all of them but the last chunk's `post`, which it
        # stops before (its output saves nothing the block's backward needs: the chunk saved its input)
        if chunks > 1:
            token_wise += fl["pre"] + fl["post"] * (chunks - 1) / chunks
        return part["block_out"], token_wise + fl["attention"]
    if recompute == "selective":
        return core_device + seq_out + part["block_out"], token_wise
    raise ValueError(f"unknown policy {recompute!r}")


def _offloaded_block(recompute: str, part: dict[str, float], p: int, dim: int, A: float,
                     seq_out: float) -> tuple[float, float]:
    """(host bytes, device bytes) per token of a block whose activations go to the host (fraction A)."""
    if recompute == "full":
        # full + offload: the one tensor a block keeps, its input, is split by tokens: the first A on
        # the host, the rest as a device copy of its own (the previous block's output is then free)
        return A * p * dim, (1 - A) * p * dim
    # selective + offload: an offloaded block keeps nothing on the device. Its input (the previous
    # block's output) and the attention state go to the host whole; of the rest, the first A of the
    # tokens' saved tensors go to the host and the other tokens are recomputed. The block input on
    # the host: the recomputed tokens' checkpoint keeps it; the stored tokens' norm keeps it too in
    # fp32 (in bf16 that norm keeps its own fp32 copy, in `norm`).
    block_input = _offloaded_block_input(part, p, dim, A)
    # the attention output in sequence layout: the core's own output when head = 1 (already
    # counted), else a tensor of its own, kept whole (stored tokens by post, the rest by its checkpoint)
    host = (part["core"] + block_input + seq_out
            + A * (part["norm"] + part["mlp_norm"] + part["qk_norm"] + part["residual"] + part["mlp"]))
    return host, 0.0


def _offloaded_block_input(part: dict[str, float], p: int, dim: int, A: float) -> float:
    """Bytes per token of a selective + offload block's input on the host: the recomputed tokens' checkpoint
    keeps it; the stored tokens' norm keeps it too in fp32 (in bf16 that norm keeps its own fp32 copy)."""
    return (1 - A) * p * dim + A * part["norm_input"]


def offloaded_tier_after_post(part: dict[str, float], p: int, dim: int, A: float) -> tuple[float, float]:
    """(pre, core): bytes per token of a selective + offload block's host tier that its backward still holds
    once its post phase (output projection, MLP) has run, brought back and freed with the phase that reads
    them: pre's (the block input, the stored tokens' attention and q/k norms' tensors) and the attention
    core's saved state. The rest of the tier (`_offloaded_block`: the MLP norm's, h, the MLP's, the attention
    output in sequence layout) is post's and gone before the core's backward (memory/transients.py)."""
    return _offloaded_block_input(part, p, dim, A) + A * (part["norm"] + part["qk_norm"]), part["core"]


def _output_held(p: int, recompute: str, i: int, layers: int, loss_chunked: bool) -> bool:
    """Whether block i's output (i = -1: the embeddings output) is still referenced after the forward
    when the block after it is not offloaded. In fp32 the next norm (the final norm after the last
    block) saves it as its input; in bf16 a norm saves its own fp32 copy instead, so only a checkpoint
    holding its input keeps it: the next block's under full or selective, the chunked loss's after
    the last block."""
    if p == 4:
        return True
    return loss_chunked if i == layers - 1 else recompute != "none"


def _final_norm_bytes(model: ModelConfig, part: dict[str, float], autocast: bool) -> float:
    """Bytes per token the final norm keeps for the plain (unchunked) loss: a block norm's, but under autocast it
    feeds one matmul, the LM head, whose bf16 cast of it is all it keeps beside its fp32 values and statistics."""
    return autocast_norm_bytes(model.dim, 2, 1) if autocast else part["norm"]


def head_weight_copy_bytes(model: ModelConfig, loss_chunked: bool, autocast: bool) -> int:
    """The LM head's bf16 weight copy that the plain loss's matmul keeps for backward under autocast over fp32
    weights (uncached: step/loss.py), [vocab, dim] once per micro-batch whatever its tokens; a chunked loss
    recomputes each chunk's logits in backward and keeps none."""
    return 2 * model.vocab_size * model.dim if autocast and not loss_chunked else 0


def _outside_blocks(model: ModelConfig, part: dict[str, float], p: int, offloaded: int, loss_chunked: bool,
                    recompute: str = "none", autocast: bool = False) -> float:
    """Device bytes per token kept outside the blocks: RoPE tables, the embeddings output, the final
    norm and what the loss keeps (the LM head's weight copy under autocast: head_weight_copy_bytes)."""
    embeddings = not offloaded and _output_held(p, recompute, -1, model.layers, loss_chunked)
    return (
        8 * model.resolved_head_dim                                     # RoPE cos/sin tables, fp32
        + (p * model.dim if embeddings else 0)                          # embeddings output = block 0's input
        # the final norm: inside a chunked loss it is recomputed per chunk and keeps nothing
        + (0 if loss_chunked else _final_norm_bytes(model, part, autocast))
        + (4 if loss_chunked else 4 * model.vocab_size)                 # lse per token, or log-softmax
    )


def loss_saved_bytes(model: ModelConfig, seq_len: int, micro_batch: int = 1, *, head: int = 1, ctx: int = 1,
                     policy: MemoryPolicy = NO_POLICY, dtype_bytes: int = 4, autocast: bool = False) -> float:
    """Device bytes of the saved activations that the loss's backward frees before any block's backward
    runs: the final norm's and the loss's own (what `_outside_blocks` counts beyond the RoPE tables and the
    embeddings output, with the LM head's weight copy under `autocast`) and the last block's output when the
    final norm or the chunked loss is what holds it (`_output_held`). A block's backward peak
    (memory/transients.py) sits on the saved total less these."""
    p, L = dtype_bytes, model.layers
    tokens = micro_batch * seq_len // (head * ctx)
    loss_chunked = bool(policy.loss_chunk) and tokens > policy.loss_chunk
    part = block_part_bytes(model, head, p)
    per_token = ((0 if loss_chunked else _final_norm_bytes(model, part, autocast))
                 + (4 if loss_chunked else 4 * model.vocab_size))
    if _output_held(p, policy.recompute, L - 1, L, loss_chunked):
        per_token += part["block_out"]
    return tokens * per_token + head_weight_copy_bytes(model, loss_chunked, autocast)


@dataclass
class LayerActivations:
    """One block's share of `estimate_activations`, in bytes per rank and micro-batch."""
    device: float
    host: float
    recompute_flops: float
    moe: bool          # a MoE layer (its feed-forward a Mixture of Experts)
    offloaded: bool    # its activations go to the host (offload_fraction > 0, not among the last kept)


def activation_dtype(bf16: bool, world: int, model_states: str, device_type: str = "cuda") -> tuple[int, bool]:
    """(bytes an activation is counted at, `autocast`: whether it runs under bf16 autocast over fp32 weights, whose
    matmuls keep bf16 weight copies) of a run
    computing in bf16 or not. Under FSDP on a GPU (world > 1, or the `host` tier's one-rank FSDP) the blocks
    run on bf16 weights gathered from fp32 shards and their inputs are cast to bf16 (parallel/fsdp/shard.py
    mixed_precision): activations are bf16. One GPU process of the `device` or `host_optimizer` tier is not
    wrapped in FSDP, and on CPU FSDP keeps fp32: bf16 autocast over fp32 weights (docs/memory.md), whose
    residual stream (every block's input and output, the embeddings' output) stays fp32 and whose matmuls
    keep autocast's bf16 copy of their weight for backward. That is counted as e = 4 with the weight copies,
    and the second value (`autocast`) has each tensor counted at its own dtype: the residual stream and the
    norms' statistics at 4 B, the matmuls' and the attention kernel's outputs at 2 B (block_part_bytes; the
    backward's transient: memory/transients.py transient_bytes). Exact for what full recomputation keeps,
    with and without offload; within 0.1% under selective (host tier included) and none, where the MLP norm's
    two casts were counted as the attention norm's three, 1.03-1.04x (tests/unit/test_autocast_accounting.py,
    test_autocast_transients.py, test_host_parts.py)."""
    if not bf16:
        return 4, False
    if device_type != "cuda" or (world == 1 and model_states != "host"):
        return 4, True
    return 2, False


def _per_token_by_kind(model: ModelConfig, seq_len: int, head: int, p: int, docs: bool, policy: MemoryPolicy,
                       expert: int, autocast: bool, chunks: int) -> dict[bool, tuple]:
    """layer_activations' per-token figures of each kind of block (MoE or not, the model's kinds only): (its
    parts, a kept block's device bytes and recomputed FLOPs, an offloaded block's host and device bytes, the
    chunked core's host state, an offloaded block's recomputed FLOPs)."""
    rc, A = policy.recompute, float(policy.offload_fraction)
    # the attention output in sequence layout is a tensor of its own under the head all-to-all, and
    # when the core's state (its output included) is in host memory (attention_offload)
    attention_offload = policy.attention_offloaded
    sparse = set(model.moe_layer_ids)
    by_kind = {}
    for moe in {i in sparse for i in range(model.layers)}:
        part = block_part_bytes(model, head, p, docs, moe=moe, autocast=autocast)
        fl = _flops_per_token(model, seq_len, moe=moe, expert=expert)
        seq_out = part["attn_out"] if head > 1 or attention_offload else 0.0
        core_device = 0.0 if attention_offload else part["core"]
        kept, recompute = _kept_block(rc, part, fl, seq_out, core_device, chunks)
        host, off_device = _offloaded_block(rc, part, p, model.dim, A, seq_out)
        # the chunked core's host-resident state, in the blocks the block offloader does not cover
        core_host = part["core"] if attention_offload and rc in ("selective", "none") else 0.0
        offloaded_recompute = recompute if rc == "full" else (1 - A) * (fl["pre"] + fl["post"] - fl["unsaved_tail"])
        by_kind[moe] = (part, kept, recompute, host, off_device, core_host, offloaded_recompute)
    return by_kind


def _weight_copy_bytes(model: ModelConfig, moe: bool, calls: list[tuple[int, bool]], policy: MemoryPolicy,
                       expert: int, expert_skew: float) -> float:
    """The bf16 weight copies autocast's saved matmuls keep in a block whose token-wise forward is stored
    (layer_activations' `autocast`): 2 B per matmul parameter, of a MoE block the experts its stored calls use."""
    if moe and model.is_moe:  # (no copy of the router's fp32 gate, nor of experts run in pieces)
        copied = experts_copied(model, calls, policy.expert_chunk, expert, expert_skew)
        return 2 * (attention_matmul_params(model) + moe_weight_copy_params(model, copied, expert))
    return 2 * matmul_params_per_layer(model, moe)


def layer_activations(model: ModelConfig, seq_len: int, micro_batch: int = 1, *, head: int = 1, ctx: int = 1,
                      policy: MemoryPolicy = NO_POLICY, dtype_bytes: int = 4,
                      docs: bool = False, expert: int = 1, expert_skew: float = 1.0,
                      autocast: bool = False, expert_replicas: int = 0,
                      expert_ranks_per_node: int = 0) -> list[LayerActivations]:
    """What each block leaves for backward under `policy` (see estimate_activations), block by
    block: a MoE model's dense and MoE layers differ; `expert`, `expert_skew`: the expert-parallel
    degree and the receive skew of the rank counted (moe_counts.moe_call_terms); `expert_replicas`: its FlexMoE
    copy slots (parallel.expert_replicas), all filled (moe_counts.copy_slot_bytes); `expert_ranks_per_node`: its
    hierarchical dispatch (parallel.expert_ranks_per_node, memory/hier_counts.py). The last offloaded block's
    device bytes include its output, which stays on the device as the input of the kept block after it.
    `autocast` (bf16 autocast over fp32 weights: activation_dtype): each matmul autograd saves keeps a
    bf16 copy of its weight on the device (the offloader leaves weights where they are), 2 B per matmul
    parameter of a block whose token-wise forward is not recomputed: every block under recompute none, the
    offloaded blocks under selective (their stored tokens' matmuls); none under full."""
    if seq_len % (head * ctx):
        raise ValueError(f"seq_len {seq_len} is not divisible by head x ctx = {head * ctx}")
    p, rc = dtype_bytes, policy.recompute
    tokens = micro_batch * seq_len // (head * ctx)
    L = model.layers
    offloaded = max(0, L - policy.offload_skip_last) if float(policy.offload_fraction) > 0 else 0
    chunks = -(-tokens // policy.block_chunk) if policy.block_chunk and tokens > policy.block_chunk else 1
    loss_chunked = bool(policy.loss_chunk) and tokens > policy.loss_chunk
    sparse = set(model.moe_layer_ids)
    by_kind = _per_token_by_kind(model, seq_len, head, p, docs, policy, expert, autocast, chunks)
    out, moe_terms = [], {}
    # a block's figures depend on its index only through these (whether it is a MoE block, offloaded, the last
    # offloaded, the last: _output_held reads i only as i == L - 1): each kind is computed once, by the same
    # operations in the same order for every block of it
    alike: dict[tuple, LayerActivations] = {}
    for i in range(L):
        moe = i in sparse
        off = i < offloaded
        kind = (moe, off, i == offloaded - 1, i == L - 1)
        same = alike.get(kind)
        if same is not None:  # (a block of its own: the caller may change it)
            out.append(LayerActivations(same.device, same.host, same.recompute_flops, same.moe, same.offloaded))
            continue
        part, kept, recompute, host, off_device, core_host, offloaded_recompute = by_kind[moe]
        if off:
            device, host_bytes, flops = tokens * off_device, tokens * host, tokens * offloaded_recompute
            if i == offloaded - 1 and _output_held(p, rc, i, L, loss_chunked):
                device += tokens * part["block_out"]
        else:
            device, host_bytes, flops = tokens * kept, tokens * core_host, tokens * recompute
            if not _output_held(p, rc, i, L, loss_chunked):  # (kept counts the block output)
                device -= tokens * part["block_out"]
        calls = moe_calls(rc, off, tokens, policy) if moe and model.is_moe else []
        if autocast and (rc == "none" or (rc == "selective" and off)):
            device += _weight_copy_bytes(model, moe, calls, policy, expert, expert_skew)
        if moe and model.is_moe:
            if off not in moe_terms:  # the same for every MoE layer offloaded (or not)
                moe_terms[off] = moe_call_terms(model, p, calls, policy.expert_chunk, off, expert, expert_skew,
                                                 c=compute_bytes(p, autocast and p == 4), replicas=expert_replicas,
                                                 ranks_per_node=expert_ranks_per_node)
            d_moe, h_moe, f_moe = moe_terms[off]
            device, host_bytes, flops = device + d_moe, host_bytes + h_moe, flops + f_moe
        alike[kind] = LayerActivations(device, host_bytes, flops, moe and model.is_moe, off)
        out.append(alike[kind])
    return out


def estimate_activations(model: ModelConfig, seq_len: int, micro_batch: int = 1, *, head: int = 1, ctx: int = 1,
                         policy: MemoryPolicy = NO_POLICY, dtype_bytes: int = 4,
                         docs: bool = False, expert: int = 1, expert_skew: float = 1.0,
                         autocast: bool = False, expert_replicas: int = 0,
                         expert_ranks_per_node: int = 0) -> ActivationEstimate:
    """Per-rank activation bytes under `policy` for micro_batch sequences of seq_len tokens sharded
    over head x ctx ranks. dtype_bytes: 4 (fp32) or 2 (bf16 parameters and activations).
    policy.block_chunk changes no saved bytes, only recomputation: under `full` the chunks are
    checkpoints nested in the block's, so the token-wise parts run once more (outer recompute, then
    each chunk's own). docs (packed documents) changes no saved bytes either (see block_part_bytes),
    nor does policy.attention_chunk (the chunked core keeps the same q, k, v, out, lse, by chunk);
    attention_offload (with attention_chunk) keeps that core state in host memory in every block
    (ops/chunked.py ChunkStore). grad_sync changes no activation.

    A MoE model's layers differ (layer_activations); the per-block figures are then its largest
    block's (a MoE one, unless dense layers keep more), the totals sum every block. autocast, expert_replicas,
    expert_ranks_per_node: see
    layer_activations (one process in bf16 autocast over fp32 weights: activation_dtype).

    A DTS-Gate model (moe.router dts) is counted at the most experts per token its schedule routes
    (memory/peak_routing.py peak_top_k: every expert at step 0); where memory.expert_chunk makes a step of fewer
    keep more (chunk_fitting_top_ks), each byte figure is the largest over those steps (recompute_flops: top_k's)."""
    kw = dict(head=head, ctx=ctx, policy=policy, dtype_bytes=dtype_bytes, docs=docs, expert=expert,
              expert_skew=expert_skew, autocast=autocast, expert_replicas=expert_replicas,
              expert_ranks_per_node=expert_ranks_per_node)
    est, *others = [_estimate_at(mk, seq_len, micro_batch, **kw)
                    for mk in peak_models(model, micro_batch * seq_len // (head * ctx), policy, expert, expert_skew)]
    peak = {f.name: max(getattr(e, f.name) for e in (est, *others))
            for f in dataclasses.fields(est) if f.name not in ("recompute_flops", "tokens")}
    return dataclasses.replace(est, **peak)


def peak_models(model: ModelConfig, tokens: int, policy: MemoryPolicy, expert: int = 1,
                expert_skew: float = 1.0) -> list[ModelConfig]:
    """The model, and as a step routing fewer experts per token counts it (peak_routing.at_top_k), each k at which
    a DTS-Gate run's calls of `tokens` rank tokens under `policy` stop running their experts in memory.expert_chunk
    pieces (chunk_fitting_top_ks; under expert parallelism by the most loaded rank's received rows): the models
    whose counts the peak is the largest of."""
    sizes = sorted({n for off in (False, True) for n, _ in moe_calls(policy.recompute, off, tokens, policy)})

    def rows_at(k: int) -> list[float]:
        return [expert_rows(n, model, expert, expert_skew, k) if expert > 1 else n * k for n in sizes]

    return [model, *(at_top_k(model, k) for k in chunk_fitting_top_ks(model, policy.expert_chunk, rows_at))]


def _estimate_at(model: ModelConfig, seq_len: int, micro_batch: int = 1, *, head: int = 1, ctx: int = 1,
                 policy: MemoryPolicy = NO_POLICY, dtype_bytes: int = 4,
                 docs: bool = False, expert: int = 1, expert_skew: float = 1.0,
                 autocast: bool = False, expert_replicas: int = 0,
                 expert_ranks_per_node: int = 0) -> ActivationEstimate:
    """estimate_activations at the model's peak_top_k."""
    moe_kw = dict(expert=expert, expert_skew=expert_skew, autocast=autocast, expert_replicas=expert_replicas,
                  expert_ranks_per_node=expert_ranks_per_node)
    layers = layer_activations(model, seq_len, micro_batch, head=head, ctx=ctx, policy=policy,
                               dtype_bytes=dtype_bytes, docs=docs, **moe_kw)
    if model.is_moe:  # (host_parts.py's pinned count reads these blocks again: layer_hosts.py)
        remember(layers_key(repr(model), seq_len, micro_batch, head, ctx, policy, dtype_bytes, docs, **moe_kw), layers)
    p = dtype_bytes
    tokens = micro_batch * seq_len // (head * ctx)
    L = model.layers
    offloaded = sum(la.offloaded for la in layers)
    loss_chunked = bool(policy.loss_chunk) and tokens > policy.loss_chunk
    model_device = _outside_blocks(model, block_part_bytes(model, head, p, docs), p, offloaded, loss_chunked,
                                   policy.recompute, autocast)
    # per-block figures: the largest block of its kind (kept, offloaded); with every block offloaded
    # (offload_skip_last 0) or none, what one of them would keep, as if it were of the other kind
    all_kept = layer_activations(model, seq_len, micro_batch, head=head, ctx=ctx,
                                 policy=dataclasses.replace(policy, offload_fraction=0.0),
                                 dtype_bytes=dtype_bytes, docs=docs, **moe_kw) if offloaded == L else layers
    kept = [la for la in all_kept if not la.offloaded]
    if offloaded:
        last = offloaded - 1
        held = _output_held(p, policy.recompute, last, L, loss_chunked)
        extra = tokens * block_part_bytes(model, head, p, docs, moe=layers[last].moe)["block_out"] if held else 0.0
        off_device = [la.device - (extra if i == last else 0.0) for i, la in enumerate(layers) if la.offloaded]
        per_block_device = max(off_device)
        per_block_host = max(la.host for la in layers if la.offloaded)
    else:
        per_block_device = max(la.device for la in kept)
        per_block_host = max(la.host for la in kept)
    return ActivationEstimate(
        per_block_device=per_block_device,
        per_block_host=per_block_host,
        kept_block_device=max(la.device for la in kept),
        model_device=tokens * model_device + head_weight_copy_bytes(model, loss_chunked, autocast),
        total_device=(sum(la.device for la in layers) + tokens * model_device
                      + head_weight_copy_bytes(model, loss_chunked, autocast)),
        total_host=sum(la.host for la in layers),
        recompute_flops=sum(la.recompute_flops for la in layers),
        tokens=tokens,
    )


def published_formulas(model: ModelConfig, seq_len: int, micro_batch: int = 1, shard: int = 1) -> dict:
    """Per-layer bytes by the published formulas (16-bit, s b h / t), for comparison only. A MoE
    model's MLP width is the mean over its layers of what a token goes through (top_k x expert_dim
    + shared_dim in a MoE layer), the formulas knowing nothing of routers and permutations."""
    sbh = seq_len * micro_batch * model.dim / shard
    sparse = set(model.moe_layer_ids)
    moe_width = model.moe_top_k * model.resolved_expert_dim + model.resolved_shared_dim
    ffn = sum(moe_width if i in sparse else model.ffn_dim for i in range(model.layers)) / max(model.layers, 1)
    return {
        "korthikanti_flash_no_recompute": (18 + 4 * ffn / model.dim) * sbh,  # Megatron's general form
        "korthikanti_full_recompute": 2 * sbh,
        "memo_skeletal": 16 * sbh,
    }
