"""Caches kept across generations on one device, so that what is built on a cache outlives one generation.

Why: a compiled decode (models/static_decode.py) builds per cache what makes its steps cheap: torch.compile's
CUDA graphs record the cache's addresses, and generate/blocks.py captures a block of 16 steps as one CUDA graph
the second time a block of that size runs on that cache. A new cache per generation paid that again every
time: one uncaptured block and one capture before the first replay (at 128 new tokens, 2 of 8 blocks at the
per-step cost). transformers' static cache and vLLM keep theirs across requests; so does this pool.

- `lease(model, batch, max_len)`: a KVCache of `batch` rows and `capacity(max_len)` slots, the pool's free one
  of that shape for that model when there is one, else a new one; back in the pool when the lease ends
  (dropped instead when the generation raised: whatever went wrong may have left it half-built). A leased
  cache is out of the pool, so two generations alive at once (a nested one, another thread, a speculative
  draft's cache beside its target's) never share one: the second gets a new cache.
- a reused cache is as a new one: empty rows (`reset`), no compiled step installed (the generation installs
  its own, or decodes eagerly), and its keys and values zeroed. Every read of a slot past a row's length is
  masked, but a mask is exact only on finite values (-inf + NaN is NaN): a previous generation may leave
  non-finite keys where nothing checked them (a row fed after its end, an fp16 overflow), and one fill costs
  what torch.zeros cost at the allocation anyway (untimed: before the prefill's clock).
- the capacity is rounded up (`capacity`) so that prompts of nearby lengths share a cache; it depends on the
  request alone, so a generation's tokens never depend on what ran before it in the process. A cache the pool
  would not keep (over POOL_BYTES: a long context's) is made at the length asked, as before.
- a cache is kept only for the same model with the same weight tensors (`weights_key`): a captured graph reads
  the weights at the addresses it was captured with, so a model whose parameters were replaced (a reload,
  `.to()`, a new rope table) gets a new cache; weights changed in place (an optimizer's step between two
  generations) stay where they were, and a graph reads them at each replay: the new values. At most MOST
  caches per model and POOL_BYTES of them are kept, the least recently used dropped first; the pool holds its
  models weakly (a model's caches go with it).
- speculative decoding's plain draft model leases its cache here too (generate/drafters.py ModelDrafter).
- LONGCTX_REUSE_CACHES=0: no pool (a new cache each lease, of the same rounded capacity: the same tokens).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import env_vars
from ..models.kv_cache import KVCache

MOST = 4  # caches kept per model: a few shapes (batch sizes, length ranges) in turn
POOL_BYTES = 1 << 30  # idle keys and values kept per model at most: device memory no longer free for other work
GRANULE = 256  # the finest rounding of a capacity, in slots


def capacity(max_len: int) -> int:
    """`max_len` rounded up to a multiple of max(GRANULE, the largest power of two <= max_len / 8): prompts
    within a granule of each other share a cache, and the slots past `max_len` are under a granule: 255 or
    1/8 of it (a compiled step attends over every slot, masked; a next power of two would double that work
    and the memory at worst)."""
    granule = max(GRANULE, 1 << max(0, (max_len // 8).bit_length() - 1))
    return -(-max_len // granule) * granule


def reuse_enabled() -> bool:
    return env_vars.switch(env_vars.REUSE_CACHES_ENV)  # (1 or 0: 'false' read as on)


def weights_key(model) -> tuple:
    """What a graph captured on `model` read: each parameter's and buffer's device, address, dtype and shape
    (an address alone is one device's: the same number on another is other memory), and the model's RoPE
    attention scale, a number the graph holds as a constant (the rest of what it computes with is the config
    the model was built with; rope tables and Ms-PoE ratios are buffers, replaced by init_rope)."""
    tensors = tuple((t.device, t.data_ptr(), t.dtype, tuple(t.shape))
                    for t in itertools.chain(model.parameters(), model.buffers()) if t is not None)
    return getattr(model, "rope_scale", None), tensors


class CachePool:
    """The free caches of each model, by (rows, capacity), least recently used first (see the module docstring)."""

    def __init__(self, most: int = MOST, pool_bytes: int = POOL_BYTES):
        self.most, self.pool_bytes = most, pool_bytes
        self._free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict
        self._lock = threading.Lock()  # (generations on several threads: a take and a give never interleave)
        self.made = 0  # caches allocated by leases (tests count them)

    @contextmanager
    def lease(self, model, batch: int, max_len: int) -> Iterator[KVCache]:
        shape, weights = (batch, self.slots(model, batch, max_len)), weights_key(model)
        cache = self._take(model, shape, weights) if reuse_enabled() else None
        if cache is None:
            cache = KVCache.for_model(model, batch, shape[1])
            self.made += 1
        done = False
        try:
            yield cache
            done = True
        finally:  # (not given back after an error: a failed call or capture may have left it or its graphs half-built)
            if done and reuse_enabled():
                self._give(model, shape, weights, cache)

    def slots(self, model, batch: int, max_len: int) -> int:
        """The cache's capacity: `capacity(max_len)`, or `max_len` itself where that cache would be over the
        pool's bytes (never kept, so never shared: a long context's cache gets no slot it does not need, its
        memory and a compiled step's attention over every slot as they were)."""
        slots = capacity(max_len)
        return slots if KVCache.for_model(model, batch, slots, device="meta").nbytes <= self.pool_bytes else max_len

    def held(self, model) -> list[KVCache]:
        """The free caches kept for `model`."""
        with self._lock:
            return [cache for _, cache in self._free.get(model, {}).values()]

    def clear(self) -> None:
        with self._lock:
            self._free = weakref.WeakKeyDictionary()

    def _take(self, model, shape: tuple, weights: tuple) -> KVCache | None:
        with self._lock:
            kept = self._free.get(model, {}).pop(shape, None)
        if kept is None or kept[0] != weights:  # (other weights: its graphs read the old ones; dropped)
            return None
        cache = kept[1]
        cache.reset()
        cache.fast = None  # (installed by a generation that compiles; an eager one must not inherit it)
        with torch.inference_mode():  # (generation makes its caches under it: inference tensors)
            cache.k.zero_()
            cache.v.zero_()
        return cache

    def _give(self, model, shape: tuple, weights: tuple, cache: KVCache) -> None:
        if cache.nbytes > self.pool_bytes:
            return
        with self._lock:
            free = self._free.setdefault(model, OrderedDict())
            free.pop(shape, None)  # (one per shape: a cache leased beside it, now back, takes its place)
            free[shape] = (weights, cache)
            while len(free) > self.most or sum(c.nbytes for _, c in free.values()) > self.pool_bytes:
                free.popitem(last=False)


POOL = CachePool()

