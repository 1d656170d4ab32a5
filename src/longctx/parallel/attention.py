"""2D sequence-parallel attention: Ulysses all-to-all over `head` around ring attention over `ctx`.

    q, k, v  [b, S/(h c), heads, d]          this rank's zigzag shard (sequence.shard_sequence)
      -- all-to-all over head -->  [b, S/c, heads/h, d]   the context rank's part, a head slice
      -- ring over ctx ---------->  attention against every block of the context group
      -- all-to-all over head -->  out [b, S/(h c), heads, d]

Each ring step then computes h times more attention per byte moved than a pure ring over h x c
ranks would (LoongTrain's argument for 2D). Either degree may be 1.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from . import comm
from .ring import ring_attention
from .ulysses import check_heads, head_to_seq, kv_replication, seq_to_head


def check_inputs(q, k, v, doc_ids, head: int, ctx: int, window: int) -> None:
    """Every shape and degree problem, reported before any communication."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"distributed_attention expects q [b, s, heads, d] and k, v [b, s, kv_heads, d]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must share batch, sequence and head_dim")
    check_heads(q.shape[2], k.shape[2], head)
    local = q.shape[1]
    if local % 2:
        seq = local * head * ctx
        raise ConfigError(
            f"sequence length {seq} (local shard {local}) is not divisible by 2 x ctx x head = {2 * ctx * head}; "
            f"the zigzag layout needs an even number of tokens per shard."
        )
    if window < 0 or (window and ctx % window):
        raise ConfigError(f"window {window} must be 0 (plain ring) or divide the context-parallel degree {ctx}.")
    if doc_ids is not None and tuple(doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"doc_ids must be shaped like the tokens [batch, local_seq] = {tuple(q.shape[:2])}, "
                         f"got {tuple(doc_ids.shape)}; shard them with shard_sequence like the tokens.")


def distributed_attention(q, k, v, mesh, *, causal=True, doc_ids=None, scale=None, window=0, backend="flash"):
    """Exact attention over the sequence sharded across the head x ctx ranks of `mesh`.

    q, k, v: this rank's shards [batch, local_seq, heads, head_dim] (k, v with kv heads) in the
    balanced layout of `shard_sequence`; doc_ids: [batch, local_seq] document ids sharded the same
    way (None = one document). Returns this rank's output shard, shaped like q; differentiable.
    """
    head_mesh, ctx_mesh = mesh["head"], mesh["ctx"]
    h, c = head_mesh.size(), ctx_mesh.size()
    check_inputs(q, k, v, doc_ids, h, c, window)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    r = kv_replication(k.shape[2], h)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    q, k, v = (seq_to_head(t, head_mesh) for t in (q, k, v))
    if doc_ids is not None:
        doc_ids = doc_ids.contiguous()  # it travels around the ring in buffers shaped like it
    if doc_ids is not None and h > 1:
        gathered = comm.all_gather(doc_ids, head_mesh, label="docs")
        doc_ids = torch.cat(list(gathered.unbind(0)), dim=1)
    out = ring_attention(q, k, v, ctx_mesh, doc=doc_ids, window=window, causal=causal, scale=scale,
                         backend=backend)
    return head_to_seq(out, head_mesh)
