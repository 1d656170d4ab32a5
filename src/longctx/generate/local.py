"""Generation's backend on one device: a KVCache, filled by a chunked or a flat (varlen) prefill.

- `prefill`: prompts of one length, `chunk` tokens per model call (each chunk's queries attend to
  the cache so far plus themselves, models/cached_attention.py), so it never builds an [S, S]
  transient; only the last position goes through the LM head.
- `prefill_flat`: short prompts of different lengths in one call, concatenated, positions restarting
  and attention masked per prompt (as packed documents train); each prompt's keys and values go to
  its cache row as each layer makes them. No padding token is ever computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ..models.kv_cache import KVCache, attend
from ..progress import LayerCounts
from .cache_pool import POOL
from .prefill_progress import prefill_phase


def prefill(model, cache: KVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed `tokens` [rows, length] (rows of one length, appended to what `cache` holds) chunk by
    chunk; the logits [rows, vocab] (fp32) of the last position. More than one chunk (a long prompt: minutes
    on a CPU) runs as a progress phase that counts the prompt tokens done, each chunk's layer by layer."""
    rows, length = tokens.shape
    chunk = chunk if chunk > 0 else length
    # (timed by FLOPs where each token attends to every earlier key: not under InfLLM's memory, another core)
    full = getattr(cache, "core", None) is attend
    with prefill_phase(rows, length, chunk, getattr(model, "cfg", None) if full else None) as progress:
        # (a chunk counted layer by layer as it runs: a late chunk of a long prompt is itself long)
        counts = LayerCounts(getattr(model, "layers", None) if length > chunk else None, progress)
        try:
            for start in range(0, length, chunk):
                counts.begin(rows * min(chunk, length - start))
                hidden = model.hidden_states(tokens[:, start:start + chunk], cache=cache)
                counts.end()
        finally:
            counts.close()
    return model.logits(hidden[:, -1]).float()


def prefill_flat(model, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Prompts of any lengths into empty cache rows (one each, in order) in one varlen call: the
    logits [rows, vocab] (fp32) of each prompt's last token."""
    device = cache.k.device
    lengths = [len(p) for p in prompts]
    tokens = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.inference_mode(False):  # a normal tensor: the attention's segment plan is cached on it
        doc_ids = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])[None]
    offsets = [0, *itertools.accumulate(lengths)]

    def keeping(index, core):
        def core_keeping(q, k, v, ids):
            for r, n in enumerate(lengths):  # each prompt's keys and values to its row
                cache.k[index, r, :, :n] = k[0, offsets[r]:offsets[r] + n].transpose(0, 1)
                cache.v[index, r, :, :n] = v[0, offsets[r]:offsets[r] + n].transpose(0, 1)
            return core(q, k, v, ids)
        return core_keeping

    cores = [block.attention.core for block in model.layers]
    for i, block in enumerate(model.layers):
        block.attention.core = keeping(i, cores[i])
    try:
        hidden = model.hidden_states(tokens, positions, doc_ids)
    finally:
        for block, core in zip(model.layers, cores):
            block.attention.core = core
    cache.lengths[:] = lengths
    return model.logits(hidden[0, [o - 1 for o in offsets[1:]]]).float()


class LocalGeneration:
    """The backend on one device (contracts.Backend and FlatPrefill): a KVCache; short prompts
    prefilled flat, long ones in chunks. Under a head x ctx layout, generate/sharded.py's
    ShardedGeneration takes its place (a sharded cache, and a prefill through training's 2D
    attention). A generation leases its cache (`lease`) from generate/cache_pool.py's pool, so that the
    compiled step's graphs built on it serve the next generation of its shape."""

    def cache(self, model, batch: int, max_len: int, core=None) -> KVCache:
        return KVCache.for_model(model, batch, max_len, core=core)

    def lease(self, model, batch: int, max_len: int, core=None):
        """A kept cache of at least `max_len` tokens (contracts.LeasedCaches); one with its own `core` (InfLLM's
        memory, a caller's) is new and not kept: its core may hold state of its generation."""
        if core is not None:
            return nullcontext(self.cache(model, batch, max_len, core=core))
        return POOL.lease(model, batch, max_len)

    def prefill(self, model, cache: KVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        return prefill(model, cache, tokens, chunk)

    def prefill_flat(self, model, cache: KVCache, prompts) -> torch.Tensor:
        return prefill_flat(model, cache, prompts)

    def repeat_rows(self, cache: KVCache, rows: int, times: int) -> None:
        """Rows [0, rows) copied to [s x rows, (s + 1) x rows) for s = 1..times-1 (a prompt's samples share
        its prefill)."""
        held = int(cache.lengths[:rows].max())
        for s in range(1, times):
            cache.k[:, s * rows:(s + 1) * rows, :, :held] = cache.k[:, :rows, :, :held]
            cache.v[:, s * rows:(s + 1) * rows, :, :held] = cache.v[:, :rows, :, :held]
            cache.lengths[s * rows:(s + 1) * rows] = cache.lengths[:rows]


LOCAL = LocalGeneration()
