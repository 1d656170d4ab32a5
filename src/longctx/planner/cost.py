"""Analytic cost of one training configuration: memory per GPU by part, bytes per mesh dim,
compute time, exposed communication, step time, tokens/s and MFU.

Everything is per GPU (rank) and exact where the implementation allows it:

- communication bytes of attention are `parallel.volumes.attention_bytes` (the closed forms that
  comm.py's counters are tested to equal), times the layers, the micro-batches and, under full
  recomputation, the forward once more; document ids cost no bytes (the training loop plans each
  batch's sequence layout on the host from the ids every rank already has, Runtime.local_batch,
  and the layout travels with the local ids to the attention core); FSDP bytes are
  `fsdp_bytes_per_step`: per micro-batch the blocks' parameters all-gathered for forward and again
  for backward, the root's once (FSDP2 keeps the root gathered from forward to backward); once per
  step (memory.grad_sync) fp32 gradients reduce-scattered and, under HSDP, all-reduced over the
  replicas (FSDP's collectives bypass comm.py's counters; `comm.library_traffic()` counts them, and tests/distributed/test_planner_validation.py
  compares a real step with this figure);
- activation memory is `memory.accounting.estimate_activations` (the formulas `longctx bench
  memory` is compared with to the byte), plus `transient_bytes`, the working set of one block's
  backward and of the LM head on top of it;
- model-state memory: fp32 parameters, gradients and two Adam moments (16 bytes/parameter; FSDP2
  keeps the sharded parameters fp32 under bf16 mixed precision too, the bf16 copies are the gathered
  ones) sharded over dp_shard x head x ctx (FSDP2, hybrid ZeRO) and replicated over dp_replicate (HSDP),
  plus the blocks FSDP holds unsharded at a time (this one and the prefetched next) and the root
  (embeddings, LM head), which stays gathered for the whole step;
- FLOPs are metrics.py's model FLOPs (the attention s^2 term halved under the causal mask), plus
  recomputation; with document masks the attention FLOPs follow the documents: they are scaled by
  `doc_work`, the visible (causal, same-document) query-key pairs over those of a plain causal mask
  (planner/documents.py; 1.0 = one document per sequence, the default; `longctx plan --store`
  measures it), since the kernels run only same-document segment pairs and the training loop's
  "docs" balance gives every context rank the same share of them. Time = GEMM FLOPs / (peak x
  gemm_efficiency) + attention FLOPs / (peak x attention_efficiency). MFU keeps metrics.py's
  causal model FLOPs (what the training metrics line reports), so with doc_work < 1 it is an
  upper bound there and here alike;
- communication time uses intra-node bandwidth for a group whose ranks fit in one node under the
  layout's placement, inter-node bandwidth otherwise. Ulysses all-to-alls block (fully exposed);
  ring hops overlap one ring step of attention compute (a Double-Ring outer hop overlaps a whole
  inner ring of `window` steps); FSDP gathers / reduce-scatters overlap their block's compute; offload
  copies overlap their block's compute; `hardware.comm_overlap` scales every overlap (0 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ModelConfig
from ..memory.accounting import (
    ActivationEstimate,
    block_part_bytes,
    estimate_activations,
)
from ..metrics import matmul_params_per_layer, train_flops_per_token
from ..parallel.volumes import attention_bytes, fsdp_bytes
from .hardware import Hardware


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    head: int = 1
    ctx: int = 1
    window: int = 0
    placement: str = "head-first"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.head * self.ctx

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Size of the FSDP shard group: dp_shard x head x ctx (contiguous ranks)."""
        return self.dp_shard * self.head * self.ctx

    @property
    def sequence_degree(self) -> int:
        return self.head * self.ctx

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"dp{self.dp_shard}")
        if self.head > 1:
            parts.append(f"head{self.head}")
        if self.ctx > 1:
            parts.append(f"ctx{self.ctx}" + (f"/w{self.window}" if self.window and self.window < self.ctx else ""))
        text = "x".join(parts) or "single"
        if self.head > 1 and self.ctx > 1:
            text += " " + ("hf" if self.placement == "head-first" else "cf")
        return text


@dataclass(frozen=True)
class Policy:
    recompute: str = "none"           # activation recomputation: none | full | selective
    offload_fraction: float = 0.0     # requires full or selective
    offload_skip_last: int = 1
    loss_chunk: int = 0               # tokens per chunk of the LM head + loss; 0 = full logits
    block_chunk: int = 0              # tokens per chunk of the blocks' token-wise stages; 0 = whole
    attention_chunk: int = 0          # tokens per chunk of the attention core; 0 = all of a rank's tokens
    attention_offload: bool = False   # the attention core's kept state in host memory (with attention_chunk)
    grad_sync: str = "step"           # with grad_accum > 1: gradients reduced once per step, or per micro_batch

    def describe(self) -> str:
        text = self.recompute
        if self.offload_fraction:
            text += f"+off{self.offload_fraction:g}"
            if self.offload_skip_last != 1:
                text += f" skip{self.offload_skip_last}"
        for tag, n in (("bc", self.block_chunk), ("ac", self.attention_chunk), ("lc", self.loss_chunk)):
            if n:
                text += f" {tag}{n // 1024}K" if n >= 1024 else f" {tag}{n}"
        if self.attention_offload:
            text += " ahost"
        if self.grad_sync != "step":
            text += " gs-micro"
        return text

    def memory_config(self) -> dict:
        """The [memory] table of a config that runs this policy."""
        return {"recompute": self.recompute, "offload_fraction": float(self.offload_fraction),
                "offload_skip_last": self.offload_skip_last, "loss_chunk": self.loss_chunk,
                "block_chunk": self.block_chunk, "attention_chunk": self.attention_chunk,
                "attention_offload": self.attention_offload, "grad_sync": self.grad_sync}


@dataclass
class Estimate:
    layout: Layout
    policy: Policy
    micro_batch: int                   # sequences per data-parallel rank per micro-batch
    grad_accum: int                    # micro-batches per optimizer step
    seq_len: int                       # tokens per sequence
    global_batch: int                  # sequences per optimizer step over the whole job
    memory: dict[str, float]           # bytes per GPU (rank) by part, and "total"
    host_per_node: float               # bytes of host memory per node for offloaded activations
    comm_bytes: dict[str, dict[str, float]]  # per rank per optimizer step: {dim: {label: bytes}}
    times: dict[str, float]            # seconds per step: compute, exposed parts, step
    tokens_per_s: float
    mfu: float
    bottleneck: str
    feasible: bool
    problems: list[str] = field(default_factory=list)
    doc_work: float = 1.0              # attention work with documents / plain causal (documents.py)

    @property
    def step_s(self) -> float:
        return self.times["step"]

    def as_dict(self) -> dict:
        L, P = self.layout, self.policy
        return {
            "layout": {"dp_replicate": L.dp_replicate, "dp_shard": L.dp_shard, "head": L.head, "ctx": L.ctx,
                       "window": L.window, "placement": L.placement},
            "policy": P.memory_config(),
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "memory_gib": {k: v / 2**30 for k, v in self.memory.items()},
            "host_per_node_gib": self.host_per_node / 2**30,
            "comm_bytes_per_step": self.comm_bytes, "times_s": self.times,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bottleneck": self.bottleneck,
            "feasible": self.feasible, "problems": self.problems, "doc_work": self.doc_work,
            "describe": f"{L.describe()} | {P.describe()} | micro-batch {self.micro_batch}",
        }


# ----------------------------------------------------------------------------------------------
# Sizes


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters of one block, of the root module (embeddings, final norm, LM head), and in total."""
    block = matmul_params_per_layer(m) + 2 * m.dim
    root = m.vocab_size * m.dim + m.dim + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return {"block": block, "root": root, "total": m.layers * block + root}


def model_state_bytes(m: ModelConfig, layout: Layout) -> float:
    """Bytes of model states per rank: fp32 parameters, gradients and AdamW's exp_avg and exp_avg_sq
    (16 per parameter), sharded over the FSDP group and replicated over dp_replicate."""
    return 16 * param_counts(m)["total"] / layout.fsdp


def fsdp_bytes_per_step(m: ModelConfig, layout: Layout, gather_bytes: int, grad_accum: int = 1,
                        grad_sync: str = "step") -> float:
    """FSDP2 bytes one rank sends per optimizer step (parallel.volumes.fsdp_bytes): per micro-batch
    every block's parameters all-gathered (`gather_bytes` each) for forward and again for backward
    and the root's (embeddings, final norm, LM head) once, each (n-1)/n of the gathered tensor;
    once per step the fp32 gradients reduce-scattered over the shard group of n ranks ((n-1)/n of
    them) and, under HSDP, the fp32 gradient shards all-reduced over the r replicas (2 (r-1)/r)."""
    pc = param_counts(m)
    return fsdp_bytes(pc["total"], layout.fsdp, layout.dp_replicate, gather_bytes, root_params=pc["root"],
                      grad_accum=grad_accum, grad_sync=grad_sync)


# ----------------------------------------------------------------------------------------------
# Activations


def activations(m: ModelConfig, seq_len: int, micro_batch: int, layout: Layout, policy: Policy,
                dtype_bytes: int, docs: bool = True) -> ActivationEstimate:
    """memory.accounting.estimate_activations (what `longctx bench memory` measures) for a layout
    and policy."""
    return estimate_activations(m, seq_len, micro_batch, head=layout.head, ctx=layout.ctx, policy=policy.recompute,
                                offload_fraction=policy.offload_fraction, offload_skip_last=policy.offload_skip_last,
                                dtype_bytes=dtype_bytes, loss_chunk=policy.loss_chunk, docs=docs,
                                block_chunk=policy.block_chunk,
                                attention_offload=policy.attention_offload and bool(policy.attention_chunk))


def sparse_attention_backward_bytes(m: ModelConfig, head: int, e: int) -> float:
    """Bytes per rank token that one document-sparse attention backward holds at its peak on top of
    its inputs, counted from ops/attention.py `_sparse_backward` (the per-group path: CPU, fp32)
    and ops/varlen.py `varlen_backward` (CUDA bf16/fp16, one varlen call per round), which
    allocate alike. Per call (a local attention, or one ring block: the rank's t x head tokens after
    the all-to-all with heads / head query heads hold as many bytes as t tokens with every head):

    - the accumulators `dq`, `dk`, `dv` = torch.zeros(..., float32) shaped like the flat q [tokens,
      heads, d] and k, v [tokens, kv heads, d] (kv heads after the all-to-all's replication), alive
      for the whole call: 4 (q_dim + 2 kv_dim) per token. (Not allocated when the pairs tile the
      tensors exactly, `_whole_tiling` / one identity round, e.g. one document per sequence or a
      ring's diagonal block: counted anyway, the planner does not know the documents per rank.)
    - the largest group's (round's) temporaries. The kernel's gradients gq, gk, gv (e (q_dim +
      2 kv_dim)) live until the next group; during the kernel call, its arguments: the rows
      `index_select`ed from dout, q, out (3 e q_dim) and k, v (2 e kv_dim) and the lse rows (fp32, 4
      per head), freed when it returns; after it, the fp32 copies for index_add_ (`gq.float()`,
      then gk's, then gv's: one at a time, at most 4 q_dim), so the larger of the two phases. A
      group holds each query row at most once (ops/segments.py `_group`, varlen `_build_rounds`),
      so its rows are bounded by the rank's tokens (a key segment serving several query segments
      of one group is gathered once per pair: a document in several pieces on one rank, rare; not
      counted). On some paths some of these are views (strided segments, identity rounds, fp32
      inputs): an upper bound (tests/unit/test_planner.py measures the CPU path under it).

    The final `.to(dtype)` copies of dq, dk, dv come after the group temporaries are gone and are
    smaller. Nothing here depends on the sequence length beyond the rank's tokens: no [S_q, S_k]
    tensor exists on any path."""
    hd = m.resolved_head_dim
    q_dim, kv_dim = m.heads * hd, max(m.kv_heads, head) * hd
    accumulators = 4 * (q_dim + 2 * kv_dim)
    kernel_grads = e * (q_dim + 2 * kv_dim)
    kernel_args = 3 * e * q_dim + 2 * e * kv_dim + 4 * m.heads
    fp32_copy = 4 * max(q_dim, kv_dim)
    return accumulators + kernel_grads + max(kernel_args, fp32_copy)


def attention_chunks(m: ModelConfig, seq_len: int, micro_batch: int, layout: Layout, policy: Policy) -> int:
    """How many chunks the attention core's sequence (a context rank's tokens after the head
    all-to-all) is cut into under memory.attention_chunk; 1 = not chunked."""
    core_tokens = micro_batch * seq_len // layout.ctx
    c = policy.attention_chunk
    return -(-core_tokens // c) if c and core_tokens > c else 1


def per_chunk_store(layout: Layout, policy: Policy) -> bool:
    """Whether the core's kept state lives on the host chunk by chunk (ops/chunked.py ChunkStore):
    with attention_offload, without a ring (a ring's kept state goes to the host whole)."""
    return bool(policy.attention_chunk) and policy.attention_offload and layout.ctx == 1


def chunk_pair_bytes(m: ModelConfig, head: int, e: int, docs: bool, offload: bool) -> float:
    """Bytes per query token of one chunk pair's backward (ops/chunked.py `_backward_loop`), in the
    core's layout counted per rank token like the rest: the query chunk's q, out, dout (e each),
    lse and its fp32 dq share, the key chunk's k, v (twice with the one-pair-ahead prefetch of
    offload); k, v repeated to every query head for the kernel and their gradients; the kernel's
    gq, gk, gv; the fp32 dk/dv accumulators of the key chunk; with documents the sparse backward
    of the pair."""
    hd = m.resolved_head_dim
    q_dim, kv_dim = m.heads * hd, max(m.kv_heads, head) * hd
    fetched = 3 * e * q_dim + 4 * m.heads + 4 * q_dim + 2 * e * kv_dim
    kernel = (4 * e * q_dim if kv_dim < q_dim else 0) + e * (q_dim + 2 * kv_dim) + 8 * kv_dim
    sparse = sparse_attention_backward_bytes(m, head, e) if docs else 0.0
    return (2 if offload else 1) * fetched + kernel + sparse


def attention_offload_host_and_traffic(m: ModelConfig, seq_len: int, micro_batch: int, layout: Layout,
                                       policy: Policy, e: int, work: float = 1.0) -> tuple[float, float]:
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
    t = micro_batch * seq_len // layout.sequence_degree
    hd = m.resolved_head_dim
    q_dim, kv_dim = m.heads * hd, max(m.kv_heads, layout.head) * hd
    core = block_part_bytes(m, layout.head, e)["core"]
    full = policy.recompute == "full"
    per_chunk = per_chunk_store(layout, policy)
    host = t * ((core if full else 0.0) + ((4 + e) * q_dim if per_chunk else 0.0))
    out = t * core * (2 if full else 1)
    if per_chunk:
        u = attention_chunks(m, seq_len, micro_batch, layout, policy)
        visits = max(1.0, (u + 1) / 2 * work)
        back = t * (visits * (3 * e * q_dim + 4 * m.heads + 8 * q_dim) + 2 * e * kv_dim + e * q_dim)
    else:
        back = t * core
    return host, out + back


def transient_bytes(m: ModelConfig, seq_len: int, micro_batch: int, layout: Layout, policy: Policy, dtype_bytes: int,
                    docs: bool = True, acts: ActivationEstimate | None = None) -> float:
    """Peak bytes on top of the saved activations (memory.accounting): the larger of the LM head's
    backward and one block's backward. A block's backward runs in phases, and what is alive in each
    follows the implementation (autograd frees a gradient once its consumer has run):

    - throughout: what comes back from the host under offload: the block's host tier and the next
      block's (prefetched one block ahead);
    - `post` backward (output projection, residual, MLP, in pieces of `block_chunk` tokens, or all
      tokens): the incoming gradient dy and the residual gradient being built (two of d), the
      attention output's gradient (sequence layout), one piece recomputed with the gradients of its
      two widest intermediates (the MLP's), and under `full` the recomputed attention state (q, k,
      v, output, log-sum-exp in the core's layout, and the output in sequence layout);
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
    - `pre` backward: the residual gradient, the input gradient being built, dq, dk, dv in the
      sequence layout (and, under the all-to-all, its head-layout copy), one piece.

    Not modelled: the attention kernel's own workspace. On CPU, glibc keeps freed heap memory
    mapped (its mmap threshold grows with the largest freed block), so a process's RSS can exceed
    the live bytes by ~2x; benchmarks compare with MALLOC_MMAP_THRESHOLD_ fixed (docs/benchmarks.md).

    The LM head holds one chunk of logits and their gradient (all tokens unchunked). Model-wise
    estimates of the allocator's behaviour; the saved activations are the exact part."""
    e = dtype_bytes
    t = micro_batch * seq_len // layout.sequence_degree
    d, hd = m.dim, m.resolved_head_dim
    part = block_part_bytes(m, layout.head, e, docs)
    q_dim, kv_dim = m.heads * hd, max(m.kv_heads, layout.head) * hd
    seq_out = part["attn_out"] if layout.head > 1 else 0.0
    both_layouts = 2 if layout.head > 1 else 1
    chunked = attention_chunks(m, seq_len, micro_batch, layout, policy) > 1
    host_chunks = chunked and per_chunk_store(layout, policy)
    X = e * d

    # the core's working set over all tokens
    if host_chunks:
        core_work = e * (q_dim + 2 * kv_dim)  # the returned dq, dk, dv; fp32 dq waits on the host
    elif chunked and layout.ctx == 1:
        core_work = 4 * q_dim + 2 * e * kv_dim  # fp32 dq accumulator, dk, dv filled key chunk by key chunk
    else:
        core_work = 4 * q_dim + 8 * kv_dim  # fp32 dq and dk/dv accumulators
    if layout.ctx > 1:
        double_ring = layout.window and layout.window < layout.ctx
        core_work += 8 * kv_dim + 2 * e * kv_dim * (2 if double_ring else 1)
    if not chunked:
        if kv_dim < q_dim:  # ops/attention.py repeats k, v per query group: expanded k, v and grads
            core_work += 4 * e * q_dim
        if docs:
            core_work += sparse_attention_backward_bytes(m, layout.head, e)
    pair = 0.0
    if chunked:
        pair = min(policy.attention_chunk / layout.head, t) * chunk_pair_bytes(m, layout.head, e, docs,
                                                                                policy.attention_offload)
    A = policy.offload_fraction
    full = policy.recompute == "full"
    if policy.recompute == "none":
        piece_tokens, piece_bytes = t, 2 * e * m.ffn_dim
    else:
        whole = t * (max(A, 1 - A) if policy.recompute == "selective" and A else 1)
        piece_tokens = min(policy.block_chunk, whole) if policy.block_chunk else whole
        post = part["norm"] + part["norm_input"] + part["residual"] + part["mlp"] + part["block_out"]
        piece_bytes = post + 2 * e * m.ffn_dim
    # the recomputed attention state under full: in post's backward (core state + the output in
    # sequence layout) and in the core's backward (core state); with the per-chunk host store only
    # the output stays on the device
    state_post = (e * q_dim if host_chunks else part["core"] + seq_out) if full else 0.0
    state_core = (0.0 if host_chunks else part["core"]) if full else 0.0
    piece = piece_tokens * piece_bytes
    post_phase = t * (2 * X + e * q_dim + state_post) + piece
    core_phase = t * (X + e * q_dim + state_core + core_work) + pair
    pre_phase = t * (2 * X + both_layouts * e * (q_dim + 2 * kv_dim)) + piece
    back = 0.0
    if A:
        acts = acts or activations(m, seq_len, micro_batch, layout, policy, e, docs)
        back = 2 * acts.per_block_host
    block = back + max(post_phase, core_phase, pre_phase)
    lm_tokens = policy.loss_chunk if policy.loss_chunk and t > policy.loss_chunk else t
    return max(block, lm_tokens * m.vocab_size * (e + 4))


# ----------------------------------------------------------------------------------------------
# Placement


def group_is_intra_node(layout: Layout, group: str, gpus_per_node: int) -> bool:
    """Whether every rank of one `group` ("head", "ctx", "window", "fsdp", "replicate") is in one node.

    A group of `size` ranks with `stride` between them spans stride x size consecutive ranks; with
    power-of-two-style divisibility it stays in one node iff that span is at most gpus_per_node."""
    h, c, w = layout.head, layout.ctx, (layout.window or layout.ctx)
    if layout.placement == "head-first":
        stride_size = {"head": (1, h), "ctx": (h, c), "window": (h, w)}
    else:
        stride_size = {"head": (c, h), "ctx": (1, c), "window": (1, w)}
    stride_size["fsdp"] = (1, layout.fsdp)
    stride_size["replicate"] = (layout.fsdp, layout.dp_replicate)
    stride, size = stride_size[group]
    return size == 1 or stride * size <= gpus_per_node


def _bw(hw: Hardware, intra: bool) -> float:
    return (hw.intra_gbps if intra else hw.inter_gbps) * 1e9


def _exposed(transfer_s: float, compute_s: float, hw: Hardware) -> float:
    return transfer_s - min(transfer_s, hw.comm_overlap * compute_s)


# ----------------------------------------------------------------------------------------------
# The estimate


def estimate(m: ModelConfig, hw: Hardware, layout: Layout, policy: Policy, *, seq_len: int, global_batch: int,
             micro_batch: int = 1, gpus_per_node: int = 8, doc_mask: bool = True, doc_work: float = 1.0,
             acts: ActivationEstimate | None = None, transient: float | None = None) -> Estimate:
    """Cost of one optimizer step of `global_batch` sequences of `seq_len` tokens (over the whole
    job) under `layout` and `policy`, `micro_batch` sequences per data-parallel rank per micro-batch
    (so global_batch / (dp x micro_batch) micro-batches per step). doc_work: the documents' visible
    query-key pairs over a plain causal mask's (planner/documents.py), in (0, 1]; ignored (1.0)
    without document masks."""
    if not 0 < doc_work <= 1:
        raise ValueError(f"doc_work must be in (0, 1], got {doc_work}")
    work = doc_work if doc_mask else 1.0
    e = hw.dtype_bytes
    L = layout
    seq = seq_len
    problems: list[str] = []
    if global_batch % (L.dp * micro_batch):
        problems.append(f"global batch {global_batch} is not divisible by dp {L.dp} x micro-batch {micro_batch}")
    grad_accum = max(1, global_batch // (L.dp * micro_batch))
    t = micro_batch * seq // L.sequence_degree  # tokens per rank per micro-batch
    pc = param_counts(m)
    hd = m.resolved_head_dim
    d_attn = m.heads * hd

    # --- memory per GPU -------------------------------------------------------------------
    if acts is None:
        acts = activations(m, seq, micro_batch, L, policy, e, doc_mask)
    gather = e  # parameters are gathered in the compute dtype (bf16 on GPU, fp32 on CPU)
    memory = {"model_states": model_state_bytes(m, L)}
    if L.world > 1:
        # two blocks gathered (this one + the prefetched next) and one block's fp32 gradient before
        # its reduce-scatter; the root stays gathered for the step, its gradient is fp32 until reduced
        memory["gathered_params"] = 2 * pc["block"] * gather + pc["block"] * 4 + pc["root"] * (gather + 4)
    else:
        memory["gathered_params"] = 0.0
    if L.world > 1 and grad_accum > 1 and policy.grad_sync == "step":
        # gradient sync off between micro-batches: FSDP2 accumulates every gradient unsharded, in fp32
        memory["accumulated_grads"] = 4 * pc["total"]
    memory["activations"] = acts.total_device
    memory["transient"] = transient if transient is not None else transient_bytes(m, seq, micro_batch, L, policy, e,
                                                                                 doc_mask, acts)
    memory["total"] = sum(memory.values())
    ranks_per_node = min(gpus_per_node, L.world)
    attn_host, attn_traffic = attention_offload_host_and_traffic(m, seq, micro_batch, L, policy, e, work)
    host_per_node = (acts.total_host + attn_host) * ranks_per_node
    if memory["total"] > hw.usable_memory_bytes:
        problems.append(f"needs {memory['total'] / 2**30:.1f} GiB per GPU, {hw.usable_memory_bytes / 2**30:.1f} "
                        f"usable of {hw.memory_gib:g}")
    if host_per_node > hw.usable_host_bytes:
        problems.append(f"offload needs {host_per_node / 2**30:.0f} GiB of host memory per node, "
                        f"{hw.usable_host_bytes / 2**30:.0f} usable")

    # --- communication bytes per rank per step -----------------------------------------------
    comm: dict[str, dict[str, float]] = {}
    shape = {"seq": seq, "batch": micro_batch, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": hd,
             "head": L.head, "ctx": L.ctx, "elem": e}
    # no docs=: that would be document ids gathered without a sequence layout; the training loop
    # always plans one on the host (Runtime.local_batch), so documents cost no bytes
    per_call = attention_bytes(**shape)                   # every layer, forward + backward
    refwd = attention_bytes(**shape, backward=False)      # every layer again under full recomputation
    for dim, labels in per_call.items():
        for label, nbytes in labels.items():
            total = nbytes + (refwd[dim].get(label, 0) if policy.recompute == "full" else 0)
            comm.setdefault(dim, {})[label] = total * m.layers * grad_accum
    fsdp = fsdp_bytes_per_step(m, L, gather, grad_accum, policy.grad_sync)
    if fsdp:
        comm["fsdp"] = {"fsdp": fsdp}

    # --- compute time ---------------------------------------------------------------------
    gemm_fwd = t * (m.layers * 2 * matmul_params_per_layer(m) + 2 * m.dim * m.vocab_size)
    causal_attn = t * m.layers * 2 * seq * d_attn  # 4 s d per token, halved by the causal mask
    # the kernels run only same-document pairs, and the "docs" balance gives each context rank
    # 1/c of them (parallel/doc_balance.py): the rank's attention work is the documents' share
    attn_fwd = causal_attn * work
    full = policy.recompute == "full"
    rec_attn = attn_fwd if full else 0.0
    # acts.recompute_flops counts the re-run attention at the causal rate; the rest is GEMMs
    rec_gemm = max(0.0, acts.recompute_flops - (causal_attn if full else 0.0))
    gemm_rate = hw.peak_flops * hw.gemm_efficiency
    attn_rate = hw.peak_flops * hw.attention_efficiency
    compute = (3 * gemm_fwd + rec_gemm) / gemm_rate + (3 * attn_fwd + rec_attn) / attn_rate
    block_fwd = (gemm_fwd / max(m.layers, 1)) / gemm_rate + (attn_fwd / max(m.layers, 1)) / attn_rate
    layer_attn_fwd = attn_fwd / max(m.layers, 1) / attn_rate

    # --- exposed communication per micro-batch ---------------------------------------------
    exposed = {"head": 0.0, "ctx": 0.0, "offload": 0.0, "attention_offload": 0.0}
    fsdp_step = 0.0  # exposed FSDP time of the whole step (its micro-batches differ)
    fwd_passes = 2 if policy.recompute == "full" else 1
    if L.head > 1:
        bw = _bw(hw, group_is_intra_node(L, "head", gpus_per_node)) * hw.all_to_all_efficiency
        exposed["head"] = sum(per_call["head"].values()) / bw * m.layers
        if policy.recompute == "full":
            exposed["head"] += sum(refwd["head"].values()) / bw * m.layers
    if L.ctx > 1:
        c, w = L.ctx, (L.window or L.ctx)
        n_outer = c // w - 1
        n_inner = c - 1 - n_outer
        hop_fwd = per_call["ctx"]["ring_kv"] / (c - 1)
        hop_bwd = (per_call["ctx"]["ring_kv_bwd"] + per_call["ctx"]["ring_dkv"]) / (c - 1)
        bw_in = _bw(hw, group_is_intra_node(L, "window", gpus_per_node))
        bw_out = _bw(hw, group_is_intra_node(L, "ctx", gpus_per_node))
        step_fwd, step_bwd = layer_attn_fwd / c, 2 * layer_attn_fwd / c
        fwd = n_inner * _exposed(hop_fwd / bw_in, step_fwd, hw) + n_outer * _exposed(hop_fwd / bw_out, w * step_fwd, hw)
        bwd = n_inner * _exposed(hop_bwd / bw_in, step_bwd, hw) + n_outer * _exposed(hop_bwd / bw_out, w * step_bwd, hw)
        exposed["ctx"] = (fwd_passes * fwd + bwd) * m.layers
    if L.world > 1:
        n, r = L.fsdp, L.dp_replicate
        bw_f = _bw(hw, group_is_intra_node(L, "fsdp", gpus_per_node))
        bw_r = _bw(hw, group_is_intra_node(L, "replicate", gpus_per_node))
        blk_gather = (n - 1) / n * pc["block"] * gather / bw_f
        blk_reduce = (n - 1) / n * pc["block"] * 4 / bw_f + 2 * (r - 1) / r * pc["block"] * 4 / n / bw_r
        block_bwd = 2 * block_fwd + (acts.recompute_flops / max(m.layers, 1)) / gemm_rate
        root_gather = (n - 1) / n * pc["root"] * gather / bw_f
        root_reduce = (n - 1) / n * pc["root"] * 4 / bw_f + 2 * (r - 1) / r * pc["root"] * 4 / n / bw_r
        # the root's gather and reduce are not hidden; gradients are reduced in the last
        # micro-batch's backward only (gradient sync is off for the others)
        last = m.layers * (_exposed(blk_gather, block_fwd, hw) + _exposed(blk_gather + blk_reduce, block_bwd, hw))
        others = m.layers * (_exposed(blk_gather, block_fwd, hw) + _exposed(blk_gather, block_bwd, hw))
        last_micro = last + root_gather + root_reduce
        other_micro = last_micro if policy.grad_sync == "micro_batch" else others + root_gather
        fsdp_step = last_micro + (grad_accum - 1) * other_micro
    if acts.per_block_host:
        offloaded = max(0, m.layers - policy.offload_skip_last)
        x = acts.per_block_host / (hw.host_link_gbps * 1e9)
        exposed["offload"] = offloaded * (_exposed(x, block_fwd, hw) + _exposed(x, 2 * block_fwd, hw))

    if attn_traffic:  # the chunks' copies overlap the block's attention work (forward, recompute, backward)
        attn_block = (3 + (1 if full else 0)) * layer_attn_fwd
        exposed["attention_offload"] = m.layers * _exposed(attn_traffic / (hw.host_link_gbps * 1e9), attn_block, hw)

    step = grad_accum * (compute + sum(exposed.values())) + fsdp_step
    times = {"compute": grad_accum * compute, **{f"exposed_{k}": grad_accum * v for k, v in exposed.items()},
             "exposed_fsdp": fsdp_step, "step": step}
    tokens = global_batch * seq
    tps = tokens / step if step > 0 else float("inf")
    mfu = tps * train_flops_per_token(m, seq) / (L.world * hw.peak_flops)
    parts = {"compute": grad_accum * compute, "head all-to-all": exposed["head"] * grad_accum,
             "ring (ctx)": exposed["ctx"] * grad_accum, "fsdp": fsdp_step,
             "offload copies": (exposed["offload"] + exposed["attention_offload"]) * grad_accum}
    bottleneck = max(parts, key=parts.get)
    if bottleneck == "compute" and policy.recompute != "none" and acts.recompute_flops:
        share = (rec_gemm + rec_attn) / (3 * (gemm_fwd + attn_fwd) + rec_gemm + rec_attn)
        if share > 0.15:
            bottleneck = f"compute ({100 * share:.0f}% recompute)"
    return Estimate(L, policy, micro_batch, grad_accum, seq, global_batch, memory, host_per_node, comm, times, tps,
                    mfu, bottleneck, not problems, problems, work)
