"""KV cache for the single-device model: preallocated keys and values, and the core that attends to them.

`KVCache` holds every layer's keys and values in two preallocated tensors
[layers, batch, kv_heads, max_len, head_dim] and how many tokens each row holds (`lengths`, on the
host: the caller always knows them, so the device is never asked). `model(tokens, positions,
cache=cache)` (models/llama.py) appends the new tokens' keys and values to every row and attends
the new queries to everything the row holds: a query at slot p sees slots 0..p (causal inside the
new tokens, everything cached before them). Prefill is the same call on a chunk of the prompt
(generate/local.py feeds it `--prefill-chunk` tokens at a time); decode is a chunk of one token.

Why head-major ([.., kv_heads, max_len, head_dim]) rather than [.., max_len, kv_heads, ..]: the
kernels read [batch, heads, seq, head_dim], so a cached prefix `k[:, :, :length]` is a strided view
they take as is, with each head's keys one contiguous run; no copy of the cache per step.

The attention itself is models/cached_attention.py. The cache's `core` (default `attend`) is what
each layer calls with the new q, k, v: it appends them and attends with `cached_attention` (or the
tree's mask). A cache sharded over head x ctx ranks (generate/sharded.py) has the same interface
(the contract: generate/contracts.py Cache) and its own layer that appends where the layout puts the
new tokens, calls the same partial attention on its shard and merges the (out, lse) over the ctx
group with the fp32 log-sum-exp (then gathers heads). Nothing here imports parallel/.
"""

from __future__ import annotations

import numpy as np
import torch

# (group_queries and ungroup_heads: the query grouping models/glide.py reads from here too)
from .cached_attention import CacheStep, cached_attention, group_queries, to_device, tree_attention, ungroup_heads

__all__ = ["CacheStep", "KVCache", "LayerCache", "TreeCalls", "attend", "group_queries", "ungroup_heads"]


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
        if k.dtype != self.cache.k.dtype:  # (else a bare "expected scalar type" from inside attention)
            raise TypeError(
                f"the model computes keys in {k.dtype} but the KV cache holds {self.cache.k.dtype}: allocate the "
                f"cache in the dtype the model computes in (KVCache.for_model(model) takes its weights' dtype; "
                f"under torch.autocast pass dtype=the autocast dtype)")
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
    return tree_attention(q, layer.k, layer.v, step).to(q.dtype)


class TreeCalls:
    """What both caches (this one and generate/sharded.py's) do for a speculative tree:
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


class CacheRows:
    """What every cache (this module's, InfLLM's and generate/sharded*.py's) holds and checks the same way:
    keys and values [layers, batch, ...] of this rank, each row's `lengths`, `max_len`, the running `step`."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: np.ndarray
    max_len: int
    step: CacheStep | None = None

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _check_room(self, new: int) -> None:
        """Before a call appends `new` tokens to every row: none running, and room for them in every row."""
        if self.step is not None:
            raise RuntimeError("a model call on this cache is already running")
        held = int(self.lengths.max())
        if held + new > self.max_len:
            raise ValueError(f"the cache holds at most {self.max_len} tokens per row; {held} held + {new} new do "
                             f"not fit (allocate it with a larger max_len)")

    def _step_positions(self, new: int, device) -> tuple[np.ndarray, torch.Tensor]:
        """Each row's first new slot (a copy of `lengths`) and the new tokens' positions [batch, new]."""
        start = self.lengths.copy()
        # made on the host, one copy without a host sync (a decode step's only host-to-device input)
        return start, to_device(start[:, None] + np.arange(new), device or self.k.device)


class KVCache(CacheRows, TreeCalls):
    """Preallocated keys and values of every layer for `batch` sequences of up to `max_len` tokens.

    `core(q, k, v, layer, step) -> out` is the attention each layer runs against the cache (default
    `attend`); a distributed cache passes its own (see the module docstring). `fast`: a compiled
    static-shape step (models/static_decode.py CompiledStep, installed after the prefill) that takes
    the model's calls it handles; None: every call runs the per-layer path."""

    fast = None

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
        self._check_room(new)
        start, positions = self._step_positions(new, device)
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
        new = int(self.lengths[0]) - start
        if not all(0 <= n < new for n in nodes):
            raise ValueError(f"keep() takes indices of the last call's {new} tokens, got {list(nodes)}")
        if list(nodes) != list(range(len(nodes))):
            # (the indexed read copies first: any order is safe; slot by slot in place, a node that an
            # earlier slot overwrote was read overwritten)
            index = torch.as_tensor([start + n for n in nodes], device=self.k.device)
            self.k[:, :, :, start:start + len(nodes)] = self.k[:, :, :, index]
            self.v[:, :, :, start:start + len(nodes)] = self.v[:, :, :, index]
        self.lengths[:] = start + len(nodes)
        self._last_start = None

    def reset(self) -> None:
        """Empty rows, and nothing of a call before: no tree mask still waiting (among() before a call
        that failed would apply to the next prompt's first call), no last call to keep()."""
        self.lengths[:] = 0
        self.step = None
        self._among, self._last_start = None, None

    def truncate(self, length: int) -> None:
        """Every row forgets its tokens past `length` (speculative decoding's rejected proposals: their
        slots are written over by the next call)."""
        if length < 0 or length > int(self.lengths.min()):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {length}")
        self.lengths[:] = length
