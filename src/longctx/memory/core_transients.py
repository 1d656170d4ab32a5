"""The attention core's backward working set, one rank's: the document-sparse backward's accumulators and
its largest group's temporaries (`sparse_attention_backward_bytes`), the chunked core's pair in flight
(ops/chunked.py: `attention_chunks`, `chunk_pair_bytes`), the whole core's working set beside a ring's blocks
(`core_working_set_bytes`), and memory.attention_offload's host bytes and traffic. memory/transients.py adds
them to a block's backward phases. Shapes and bytes per rank and micro-batch, as there.
"""

from __future__ import annotations

from ..config import ModelConfig
from .block_parts import block_part_bytes
from .policy import MemoryPolicy


def attention_widths(m: ModelConfig, head: int) -> tuple[int, int]:
    """Elements per token of q (every query head) and of k or v (kv heads after the head
    all-to-all's replication, at least `head`)."""
    hd = m.resolved_head_dim
    return m.heads * hd, max(m.kv_heads, head) * hd


def sparse_attention_backward_bytes(m: ModelConfig, head: int, e: int) -> float:
    """Bytes per rank token that one document-sparse attention backward holds at its peak on top of
    its inputs, counted from ops/attention.py `_sparse_backward` (the per-group path: CPU, fp32)
    and ops/varlen.py `varlen_backward` (CUDA bf16/fp16, one varlen call per round), which
    allocate alike. Per call (a local attention, or one ring block: the rank's t x head tokens after
    the all-to-all with heads / head query heads hold as many bytes as t tokens with every head):

    - the accumulators `dq`, `dk`, `dv` = torch.zeros(..., float32) shaped like the flat q [tokens,
      heads, d] and k, v [tokens, kv heads, d] (kv heads after the all-to-all's replication), alive
      for the whole call: 4 (q_dim + 2 kv_dim) per token; and the log-sum-exp made token-major (the
      per-group path's `lse_t`, a reshape of its transpose: a copy) or fp32 [heads, tokens] (varlen's
      `lse_t`), 4 per head, alive for the whole call too. (Not allocated when the pairs tile the
      tensors exactly, `_whole_tiling` / one identity round, e.g. one document per sequence or a
      ring's diagonal block: counted anyway, the planner does not know the documents per rank.)
    - the largest group's (round's) temporaries. The kernel's gradients gq, gk, gv (e (q_dim +
      2 kv_dim)) live until the next group; during the kernel call, its arguments: the rows
      `index_select`ed from dout, q, out (3 e q_dim) and k, v (2 e kv_dim) and the lse rows (fp32, 4
      per head) with their finite copy for the kernel (`torch.where(isinf(lse), 0, lse)`, 4 per head;
      with it and `lse_t` uncounted, one group of 2,040 of 2,048 tokens in gathered rows peaked 1.0004x
      over the count in fp32: tests/unit/test_transient_tightening.py), freed when it returns; after
      it, the fp32 copies for index_add_ (`gq.float()`, then gk's, then gv's: one at a time, at most
      4 q_dim), so the larger of the two phases. A
      group holds each query row at most once (ops/segments.py `_group`, varlen `_build_rounds`),
      so its rows are bounded by the rank's tokens (a key segment serving several query segments
      of one group is gathered once per pair: a document in several pieces on one rank, rare; not
      counted). On some paths some of these are views (strided segments, identity rounds, fp32
      inputs): an upper bound (tests/unit/test_memory_transients.py measures the CPU path under it),
      which the data's layout decides, not the length: an unchunked core's backward with two
      documents (one segment per group, views) measured 1.50-1.72x under this count at 2,048 and
      4,096 tokens, one group of equal documents at uneven offsets (rows gathered) 1.01-1.08x.

    The final `.to(dtype)` copies of dq, dk, dv come after the group temporaries are gone and are
    smaller. Nothing here depends on the sequence length beyond the rank's tokens: no [S_q, S_k]
    tensor exists on any path."""
    q_dim, kv_dim = attention_widths(m, head)
    accumulators = 4 * (q_dim + 2 * kv_dim) + 4 * m.heads
    kernel_grads = e * (q_dim + 2 * kv_dim)
    kernel_args = 3 * e * q_dim + 2 * e * kv_dim + 8 * m.heads
    fp32_copy = 4 * max(q_dim, kv_dim)
    return accumulators + kernel_grads + max(kernel_args, fp32_copy)


def attention_chunks(seq_len: int, ctx: int, policy: MemoryPolicy) -> int:
    """How many chunks each row of the attention core's sequence (a context rank's tokens after the head
    all-to-all) is cut into under memory.attention_chunk; 1 = not chunked. ops/chunked.py cuts every row
    alike (`chunk_slices` of the row's seq / ctx tokens), so a chunk pair holds micro_batch x chunk tokens
    and the micro-batch changes the chunks' size, not their number (counted end to end, the chunks were
    micro_batch times too many and each too small: tests/unit/test_peaks_audit_micro_batch.py)."""
    row_tokens = seq_len // ctx
    c = policy.attention_chunk
    return -(-row_tokens // c) if c and row_tokens > c else 1


def per_chunk_store(ctx: int, policy: MemoryPolicy) -> bool:
    """Whether the core's kept state lives on the host chunk by chunk (ops/chunked.py ChunkStore):
    with attention_offload, without a ring (a ring's kept state goes to the host whole)."""
    return bool(policy.attention_chunk) and policy.attention_offload and ctx == 1


def chunk_pair_bytes(m: ModelConfig, head: int, e: int, docs: bool, offload: bool) -> float:
    """Bytes per query token of one chunk pair's backward (ops/chunked.py `_backward_loop`), in the
    core's layout counted per rank token like the rest: the query chunk's q, out, dout (e each),
    lse and its fp32 dq share, the key chunk's k, v (twice with the one-pair-ahead prefetch of
    offload); k, v repeated to every query head for the kernel and their gradients; the kernel's
    gq, gk, gv; the fp32 dk/dv accumulators of the key chunk; with documents the sparse backward
    of the pair."""
    q_dim, kv_dim = attention_widths(m, head)
    fetched = 3 * e * q_dim + 4 * m.heads + 4 * q_dim + 2 * e * kv_dim
    kernel = (4 * e * q_dim if kv_dim < q_dim else 0) + e * (q_dim + 2 * kv_dim) + 8 * kv_dim
    sparse = sparse_attention_backward_bytes(m, head, e) if docs else 0.0
    return (2 if offload else 1) * fetched + kernel + sparse


def attention_offload_host_and_traffic(m: ModelConfig, seq_len: int, micro_batch: int, *, head: int, ctx: int,
                                       policy: MemoryPolicy, dtype_bytes: int,
                                       work: float = 1.0) -> tuple[float, float]:
    """memory.attention_offload: (host bytes per rank beyond the saved activations, bytes moved
    between device and host per block and micro-batch).

    Host: under `full` the block in backward keeps its recomputed core state (q, k, v, out, lse) on
    the host; with the per-chunk store also the fp32 dq accumulators and dout. (Under selective the
    core state is a saved activation, counted by memory.accounting.)
    Traffic: the core state goes out once per forward (twice under full: forward and recompute).
    A ring's state comes back whole for its backward; the per-chunk store brings back a query chunk
    (q, out, dout, lse and its fp32 dq, which also goes out again) for every key chunk it sees,
    ~ (u + 1) / 2 times for u chunks under a causal mask (fewer with documents: `work`), and each
    key chunk once: the O(u^2) chunk moves of FPDT."""
    if not (policy.attention_chunk and policy.attention_offload):
        return 0.0, 0.0
    e = dtype_bytes
    t = micro_batch * seq_len // (head * ctx)
    q_dim, kv_dim = attention_widths(m, head)
    core = block_part_bytes(m, head, e)["core"]
    full = policy.recompute == "full"
    per_chunk = per_chunk_store(ctx, policy)
    host = t * ((core if full else 0.0) + ((4 + e) * q_dim if per_chunk else 0.0))
    out = t * core * (2 if full else 1)
    if per_chunk:
        u = attention_chunks(seq_len, ctx, policy)
        visits = max(1.0, (u + 1) / 2 * work)
        back = t * (visits * (3 * e * q_dim + 4 * m.heads + 8 * q_dim) + 2 * e * kv_dim + e * q_dim)
    else:
        back = t * core
    return host, out + back


# ------------------------------------------------------------------------------------------------
# One block's backward, by phases


def core_working_set_bytes(m: ModelConfig, *, head: int, ctx: int, window: int, e: int, docs: bool,
                           chunked: bool, host_chunks: bool) -> float:
    """Bytes per rank token of the attention core's backward working set over all of the rank's
    tokens (see transient_bytes: accumulators, a ring's blocks in flight, and unchunked the
    grouped-query repeat and the document-sparse temporaries)."""
    q_dim, kv_dim = attention_widths(m, head)
    if host_chunks:
        work = e * (q_dim + 2 * kv_dim)  # the returned dq, dk, dv; fp32 dq waits on the host
    elif chunked and ctx == 1:
        work = 4 * q_dim + 2 * e * kv_dim  # fp32 dq accumulator, dk, dv filled key chunk by key chunk
    elif docs and ctx == 1:
        # one document-sparse backward over the rank's tokens: its fp32 dq, dk, dv accumulators are these
        # (ops/attention.py _sparse_backward), counted with its temporaries below, not twice
        work = 0.0
    else:
        work = 4 * q_dim + 8 * kv_dim  # fp32 dq and dk/dv accumulators
    if ctx > 1:
        double_ring = window and window < ctx
        work += 8 * kv_dim + 2 * e * kv_dim * (2 if double_ring else 1)
    if not chunked:
        if kv_dim < q_dim:  # ops/attention.py repeats k, v per query group: expanded k, v and grads
            work += 4 * e * q_dim
        if docs:
            work += sparse_attention_backward_bytes(m, head, e)
    return work
