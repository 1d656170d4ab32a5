"""Attention of new queries against the keys and values a KV cache holds (models/kv_cache.py holds them).

One model call on a cache is a `CacheStep`: every row appends `new` tokens after the `start` it
held; the new query at slot p sees slots 0..p (causal among the new tokens), or, for a speculative
tree, the held slots and the new tokens its `among` mask names.

`cached_attention` returns the partial attention (out and its log-sum-exp) over the slots a cache
holds:
- decode (one new token per row): one kernel call over the keys each row holds. The query heads of
  one kv head are laid along the query axis ([b, 1, h, d] -> [b, g, kv, d]), so grouped-query
  attention reads the cache once per kv head and never repeats it per query head. Rows of different
  lengths (a batch of prompts) are one call with a key-padding mask of [b, 1, 1, L] (CPU; elsewhere
  a plain fp32 matmul softmax over the same keys).
- several new tokens (a prefill chunk): the cached prefix (every key precedes every query: full
  attention, queries grouped as above) and the chunk itself (causal) are two kernel calls, merged by
  the log-sum-exp in fp32 exactly as the ring merges its blocks (ops/attention.py merge_partials).
  Nothing is [S, S]: the transient is one chunk's queries against the keys held, inside the kernel.
- a few new tokens on a CPU (a speculative chain or tree to verify): one masked kernel call over the
  held slots and the new ones (`SMALL_CHUNK`): the CPU kernel's fixed cost per call is most of a
  decode step's attention there.
A cache sharded over head x ctx ranks (generate/sharded.py) calls the same partial attention on its
shard and merges the (out, lse) over the ctx group. Nothing here imports parallel/ or the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops.attention import attention_forward, merge_partials


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """A host array on `device` without a host sync: on a GPU through pinned memory, non-blocking (a
    blocking copy waits for every kernel queued before it; from pageable memory a non-blocking one may
    too). The caching host allocator keeps the pinned block until the copy is done."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class CacheStep:
    """One call of the model on a cache: every row appends `new` tokens after the `start` it held."""

    start: np.ndarray        # [batch] tokens each row held before this call (host)
    new: int                 # tokens appended to every row
    positions: torch.Tensor  # [batch, new] the new tokens' positions (= their slots)
    # [new, new] bool: which new tokens each new token sees (a speculative tree's ancestors and itself);
    # None: causal among them (a chain, a prefill chunk)
    among: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    @property
    def uniform(self) -> bool:
        return bool(np.all(self.start == self.start[0]))

    def key_mask(self, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive key-padding mask [batch, 1, 1, L] for one new token per row of ragged lengths:
        0 for the slots a row holds (its new token included), -inf after. Built once per step,
        shared by every layer."""
        if dtype not in self._masks:
            held = torch.as_tensor(self.start + self.new, device=device)
            slots = torch.arange(int(held.max()), device=device)
            mask = torch.zeros((len(self.start), 1, 1, len(slots)), dtype=dtype, device=device)
            mask.masked_fill_(slots[None, None, None, :] >= held[:, None, None, None], float("-inf"))
            self._masks[dtype] = mask
        return self._masks[dtype]


    def chunk_mask(self, dtype: torch.dtype, group: int, device) -> torch.Tensor:
        """Additive mask [1, 1, new * group, held] for a few new tokens on rows that held `start`
        tokens, queries grouped as group_queries lays them (row i * group + j is new token i): every
        held slot, and among the new ones causally or by the tree (`among`). Built once per step."""
        key = (dtype, group)
        if key not in self._masks:
            s, n = int(self.start[0]), self.new
            visible = torch.ones(n, s + n, dtype=torch.bool, device=device)
            visible[:, s:] = self.among.to(device) if self.among is not None else \
                torch.ones(n, n, dtype=torch.bool, device=device).tril()
            mask = torch.zeros(n, s + n, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self._masks[key] = mask.repeat_interleave(group, dim=0)[None, None]
        return self._masks[key]


def tree_attention(q, k, v, step: CacheStep) -> torch.Tensor:
    """New tokens of a tree (one row, or rows holding the same prefix): the cached prefix in full,
    the new tokens by `step.among`, merged by the log-sum-exp in fp32."""
    if not step.uniform:
        raise ValueError("a tree of new tokens is verified on rows that hold the same number of tokens")
    if _one_call(q, step):
        return _small_chunk(q, k, v, step, 1.0 / math.sqrt(q.shape[-1]))[0]
    s, n = int(step.start[0]), q.shape[1]
    out, lse = masked_attention(q, k[:, :, s:s + n], v[:, :, s:s + n], step.among.to(q.device))
    if s:
        pre_out, pre_lse = _full(q, k[:, :, :s], v[:, :, :s], 1.0 / math.sqrt(q.shape[-1]))
        out, _ = merge_partials(pre_out, pre_lse, out, lse)
    return out


def group_queries(q: torch.Tensor, kv: int) -> torch.Tensor:
    """[b, n, h, d] -> [b, kv, n * g, d]: GQA without repeating the keys, a kv head's g query heads
    its rows of queries (row i * g + j: token i, its head j): what an SDPA call over [b, kv, L, d] takes."""
    b, n, h, d = q.shape
    return q.view(b, n, kv, h // kv, d).permute(0, 2, 1, 3, 4).reshape(b, kv, n * (h // kv), d)


def ungroup_heads(out: torch.Tensor, n: int, heads: int) -> torch.Tensor:
    """group_queries' inverse for an output: [b, kv, n * g, d] -> [b, n, heads, d]."""
    b, kv, _, d = out.shape
    return out.view(b, kv, n, heads // kv, d).permute(0, 2, 1, 3, 4).reshape(b, n, heads, d)


def _ungroup(out: torch.Tensor, lse: torch.Tensor, n: int, heads: int):
    """group_queries' inverse for (out [b, kv, n * g, d], lse [b, kv, n * g]) -> ([b, n, heads, d], [b, heads, n])."""
    b, kv = lse.shape[:2]
    lse = lse.view(b, kv, n, heads // kv).transpose(2, 3).reshape(b, heads, n)
    return ungroup_heads(out, n, heads), lse


def _full(q, k, v, scale):
    """Every query sees every key (k/v [b, kv, L, d] views of the cache): (out, lse)."""
    heads, n = q.shape[2], q.shape[1]
    out, lse = attention_forward(group_queries(q, k.shape[1]).transpose(1, 2), k.transpose(1, 2),
                                 v.transpose(1, 2), causal=False, scale=scale)
    return _ungroup(out.transpose(1, 2), lse, n, heads)


def full_attention(q, k, v, scale=None):
    """(out [b, n, h, d] in q's dtype, lse [b, h, n] fp32) of q [b, n, h, d] over every key of k/v
    [b, kv_heads, L, d] (views of a cache): one kernel call, queries grouped per kv head (no copy of
    the keys per query head, no [h, n, L] fp32 scores outside the kernel)."""
    return _full(q, k, v, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def _masked(q, k, v, mask, scale):
    """_full with an additive key mask [b, 1, 1, L] (rows of different lengths, one query each)."""
    heads, n, kv = q.shape[2], q.shape[1], k.shape[1]
    qg = group_queries(q, kv)  # [b, kv, n * g, d]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False,
                                                                              attn_mask=mask, scale=scale)
    else:  # a plain fp32 softmax over the same keys (decode reads each key once either way)
        s = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale + mask.float()
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return _ungroup(out, lse.float(), n, heads)


def _chunk(q, k, v, start: int, scale):
    """New queries at slots start.. start+n-1 of one or more rows that all held `start` tokens: the
    cached prefix in full, the chunk itself causally, merged by the log-sum-exp in fp32."""
    n = q.shape[1]
    own_k, own_v = k[:, :, start:start + n].transpose(1, 2), v[:, :, start:start + n].transpose(1, 2)
    out, lse = attention_forward(q, own_k, own_v, causal=True, scale=scale)
    if start == 0:
        return out, lse
    pre_out, pre_lse = _full(q, k[:, :, :start], v[:, :, :start], scale)
    out, lse = merge_partials(pre_out, pre_lse, out, lse)
    return out.to(q.dtype), lse


SMALL_CHUNK = 64  # new tokens up to which a CPU call attends in one kernel call with a mask


def _one_call(q, step: CacheStep) -> bool:
    """A few new tokens (a speculative chain or tree to verify) on a CPU, rows of one length: one
    masked kernel call over the prefix and the new tokens instead of two calls and a merge. The
    CPU kernel's fixed cost per call (~70 us) is most of a decode step's attention there."""
    return q.device.type == "cpu" and 1 < q.shape[1] <= SMALL_CHUNK and step.uniform


def _small_chunk(q, k, v, step: CacheStep, scale):
    """(out [b, n, h, d], lse [b, h, n] fp32): the n new queries over the held slots and each other
    (step.chunk_mask), one call of the CPU flash kernel with queries grouped per kv head."""
    b, n, h, d = q.shape
    kv = k.shape[1]
    held = int(step.start[0]) + n
    mask = step.chunk_mask(q.dtype, h // kv, q.device)
    qg = group_queries(q, kv)  # [b, kv, n * g, d]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k[:, :, :held], v[:, :, :held], 0.0, False, attn_mask=mask, scale=scale)
    return _ungroup(out, lse.float(), n, h)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale=None):
    """(out [b, n, h, d] fp32, lse [b, h, n] fp32) of q [b, n, h, d] over the keys k/v [b, kv_heads, L, d]
    that `visible` ([b, n, L] or [n, L], bool) lets each query see; a query that sees none gets out 0,
    lse -inf. A plain fp32 softmax: for a few new tokens (a speculative tree or chain to verify)."""
    b, n, h, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    group = h // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)  # [b, h, L, d]
    scores = torch.einsum("bnhd,bhld->bhnl", q.float(), kk) * scale
    visible = visible if visible.dim() == 3 else visible[None].expand(b, -1, -1)
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.einsum("bhnl,bhld->bnhd", torch.exp(scores - safe[..., None]), vv), lse


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: CacheStep, *, scale=None):
    """(out [b, n, h, d], lse [b, h, n] fp32) of the new queries q [b, n, h, d] against the cache
    k/v [b, kv_heads, max_len, d], which already holds their own keys: the query at slot p of a row
    sees slots 0..p. This is the partial attention a sharded cache merges over its ranks."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    n = q.shape[1]
    if n == 1:
        if step.uniform:
            held = int(step.start[0]) + 1
            return _full(q, k[:, :, :held], v[:, :, :held], scale)
        mask = step.key_mask(q.dtype, q.device)
        held = mask.shape[-1]
        return _masked(q, k[:, :, :held], v[:, :, :held], mask, scale)
    if _one_call(q, step):  # (a chain: a tree goes through _tree_attention)
        return _small_chunk(q, k, v, step, scale)
    if step.uniform:
        return _chunk(q, k, v, int(step.start[0]), scale)
    # several new tokens on rows of different lengths (rare: e.g. verifying drafts in a batch): row by
    # row, each a view of its own cache
    outs, lses = zip(*(_chunk(q[r:r + 1], k[r:r + 1], v[r:r + 1], s, scale) for r, s in enumerate(step.start.tolist())))
    return torch.cat(outs), torch.cat(lses)
