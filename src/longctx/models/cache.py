"""KV cache for the single-device model: preallocated keys and values, and attention against them.

`KVCache` holds every layer's keys and values in two preallocated tensors
[layers, batch, kv_heads, max_len, head_dim] and how many tokens each row holds (`lengths`, on the
host: the caller always knows them, so the device is never asked). `model(tokens, positions,
cache=cache)` (models/llama.py) appends the new tokens' keys and values to every row and attends
the new queries to everything the row holds: a query at slot p sees slots 0..p (causal inside the
new tokens, everything cached before them). Prefill is the same call on a chunk of the prompt
(generate/engine.py feeds it `--prefill-chunk` tokens at a time); decode is a chunk of one token.

Why head-major ([.., kv_heads, max_len, head_dim]) rather than [.., max_len, kv_heads, ..]: the
kernels read [batch, heads, seq, head_dim], so a cached prefix `k[:, :, :length]` is a strided view
they take as is, with each head's keys one contiguous run; no copy of the cache per step.

Attention with a cache (`cached_attention`, the partial attention: out and its log-sum-exp):
- decode (one new token per row): one kernel call over the keys each row holds. The query heads of
  one kv head are laid along the query axis ([b, 1, h, d] -> [b, g, kv, d]), so grouped-query
  attention reads the cache once per kv head and never repeats it per query head. Rows of different
  lengths (a batch of prompts) are one call with a key-padding mask of [b, 1, 1, L] (CPU; elsewhere
  a plain fp32 matmul softmax over the same keys).
- several new tokens (a prefill chunk): the cached prefix (every key precedes every query: full
  attention, queries grouped as above) and the chunk itself (causal) are two kernel calls, merged by
  the log-sum-exp in fp32 exactly as the ring merges its blocks (ops/attention.py merge_partials).
  Nothing is [S, S]: the transient is one chunk's queries against the keys held, inside the kernel.

The seam for distributed decoding: the cache's `core` (default `attend`) is what each layer calls
with the new q, k, v; it appends and calls `cached_attention`, which returns (out, lse) of the keys
this cache holds. A cache sharded over head x ctx ranks keeps its heads' keys of its own sequence
positions and swaps in a core that appends where the layout puts the new tokens, calls the same
partial attention on its shard and merges the (out, lse) over the ctx group with the fp32
log-sum-exp (then gathers heads). Nothing here imports parallel/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops.attention import attention_forward, merge_partials


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


class LayerCache:
    """One layer's view of a KVCache: what a block's attention calls with its new q, k, v."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def k(self) -> torch.Tensor:  # [batch, kv_heads, max_len, head_dim]
        return self.cache.k[self.index]

    @property
    def v(self) -> torch.Tensor:
        return self.cache.v[self.index]

    def append(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> None:
        """Write the new keys and values [batch, new, kv_heads, head_dim] after each row's tokens."""
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        if step.uniform:
            s = int(step.start[0])
            self.k[:, :, s:s + step.new] = kt
            self.v[:, :, s:s + step.new] = vt
            return
        for r, s in enumerate(step.start.tolist()):
            self.k[r, :, s:s + step.new] = kt[r]
            self.v[r, :, s:s + step.new] = vt[r]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [batch, new, heads, head_dim] of the new tokens over this layer's cache."""
        return self.cache.core(q, k, v, self, self.cache.step)


def attend(q, k, v, layer: LayerCache, step: CacheStep) -> torch.Tensor:
    """The single-device cache core: append the new keys and values, attend to all the row holds
    (the new tokens among themselves causally, or by the step's tree)."""
    layer.append(k, v, step)
    if step.among is None:
        out, _ = cached_attention(q, layer.k, layer.v, step)
        return out
    return _tree_attention(q, layer.k, layer.v, step).to(q.dtype)


def _tree_attention(q, k, v, step: CacheStep) -> torch.Tensor:
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


class TreeCalls:
    """What both caches (this one and parallel/generation.py's sharded one) do for a speculative tree:
    `among(visible)` sets how the next call's new tokens see each other, and `keep(nodes)` then
    keeps only those of its tokens (the accepted path, in order) after what the rows held."""

    _among: torch.Tensor | None = None

    def among(self, visible: torch.Tensor) -> None:
        """For the next call only: new token j sees new token i when visible[j, i] ([new, new] bool)."""
        self._among = visible

    def _take_among(self, new: int) -> torch.Tensor | None:
        visible, self._among = self._among, None
        if visible is not None and tuple(visible.shape) != (new, new):
            raise ValueError(f"a tree mask of shape {tuple(visible.shape)} for a call of {new} new tokens")
        return visible


class KVCache(TreeCalls):
    """Preallocated keys and values of every layer for `batch` sequences of up to `max_len` tokens.

    `core(q, k, v, layer, step) -> out` is the attention each layer runs against the cache (default
    `attend`); a distributed cache passes its own (see the module docstring)."""

    def __init__(self, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", core=None):
        shape = (layers, batch, kv_heads, max_len, head_dim)
        # zeros, not empty: a masked-out slot must never hold a NaN (0 x NaN is NaN in the kernel)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.max_len = max_len
        self.core = attend if core is None else core
        self.step: CacheStep | None = None
        self._last_start: np.ndarray | None = None  # where the last call's tokens start (keep)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: str | torch.device | None = None, core=None) -> KVCache:
        """A cache shaped for `model` (a models.llama.Llama), in its weights' dtype and device by default."""
        cfg, w = model.cfg, model.tok_embeddings.weight
        return cls(cfg.layers, batch, max_len, cfg.kv_heads, cfg.resolved_head_dim,
                   dtype=dtype or w.dtype, device=device or w.device, core=core)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows [start, stop) as a cache of their own, sharing storage and lengths with this one
        (prefill a group of prompts of one length in it)."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop]  # a numpy view: appends show in the whole cache
        view.max_len, view.core, view.step, view._last_start = self.max_len, self.core, None, None
        return view

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def begin(self, new: int, device=None) -> CacheStep:
        """Start a call that appends `new` tokens to every row (the model calls it)."""
        if self.step is not None:
            raise RuntimeError("a model call on this cache is already running")
        if self.lengths.max() + new > self.max_len:
            raise ValueError(f"the cache holds at most {self.max_len} tokens per row; {int(self.lengths.max())} "
                             f"held + {new} new do not fit (allocate it with a larger max_len)")
        start = self.lengths.copy()
        positions = torch.as_tensor(start, device=device or self.k.device)[:, None] + \
            torch.arange(new, device=device or self.k.device)
        self.step = CacheStep(start, new, positions, self._take_among(new))
        return self.step

    def end(self, ok: bool = True) -> None:
        """Finish the call: the rows now hold the new tokens (ok), or the call is forgotten (an error
        inside the model: what it wrote lies past the lengths and is overwritten next time)."""
        if ok and self.step is not None:
            self.lengths += self.step.new
            self._last_start = self.step.start
        self.step = None

    def keep(self, nodes: list[int]) -> None:
        """Of the last call's tokens, keep `nodes` (their indices in the call, in the order the rows
        now continue with), moved to the slots right after what the rows held before it."""
        if self._last_start is None or not np.all(self._last_start == self._last_start[0]):
            raise ValueError("keep() follows a call on rows that held the same number of tokens")
        start = int(self._last_start[0])
        for slot, node in enumerate(nodes):
            if node != slot:
                self.k[:, :, :, start + slot] = self.k[:, :, :, start + node]
                self.v[:, :, :, start + slot] = self.v[:, :, :, start + node]
        self.lengths[:] = start + len(nodes)
        self._last_start = None

    def reset(self) -> None:
        self.lengths[:] = 0
        self.step = None

    def truncate(self, length: int) -> None:
        """Every row forgets its tokens past `length` (speculative decoding's rejected proposals: their
        slots are written over by the next call)."""
        if length < 0 or length > int(self.lengths.min()):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {length}")
        self.lengths[:] = length


# ----------------------------------------------------------------------------------------------
# Attention of new queries against the keys a cache holds


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
