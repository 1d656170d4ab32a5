"""ShardedKVCache.read_attention (a GliDe draft's cross-attention over a sharded target cache) takes the
queries READ_ROWS at a time: the draft's prompt pass reads with every prompt position at once, and one call
built a [b, n, slots] mask and [b, heads, n, slots] fp32 scores, quadratic in the prompt (one device's
cross_attention goes 1,024 queries at a time). One rank (head 1 x ctx 1: no collective is called)."""

import numpy as np
import torch

from longctx.generate import sharded
from longctx.generate.sharded import ShardedKVCache
from longctx.models.cached_attention import masked_attention
from probes import LargestOutput

HEADS, KV, D = 4, 2, 8


def _one_rank_cache(held: int, seed: int = 0) -> ShardedKVCache:
    g = torch.Generator().manual_seed(seed)
    c = object.__new__(ShardedKVCache)
    c.h = c.c = 1
    c.head_rank = c.ctx_rank = 0
    c.heads_local, c.kv_local = HEADS, KV
    c.k = torch.randn(2, 1, KV, held, D, generator=g)
    c.v = torch.randn(2, 1, KV, held, D, generator=g)
    c.shares = np.array([[held]])
    # slots out of position order (as a prefill's zigzag shard and round-robin decode leave them)
    c.slot_positions = np.random.default_rng(seed).permutation(held)[None]
    return c


def _inputs(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, HEADS, D, generator=g)
    limit = (torch.arange(n) // 4 * 4)[None]  # block-stale: position i reads the positions before its block of 4
    return q, limit


def test_read_attention_never_builds_queries_by_slots(monkeypatch):
    monkeypatch.setattr(sharded, "READ_ROWS", 64, raising=False)
    n = 640
    cache = _one_rank_cache(n)
    q, limit = _inputs(n)
    probe = LargestOutput()
    with probe:
        cache.read_attention(1, q, limit)
    assert probe.largest <= HEADS * 64 * n, (probe.largest, HEADS * n * n)


def test_read_attention_in_rows_equals_one_masked_call(monkeypatch):
    monkeypatch.setattr(sharded, "READ_ROWS", 64, raising=False)
    n = 300  # not a multiple of the rows: a short last block; position 0..3 see nothing (out 0)
    cache = _one_rank_cache(n)
    q, limit = _inputs(n)
    got = cache.read_attention(1, q, limit)
    positions = torch.as_tensor(cache.slot_positions)
    visible = positions[:, None, :] < limit[:, :, None]
    want, _ = masked_attention(q, cache.k[1], cache.v[1], visible)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[:, :4], torch.zeros_like(got[:, :4]))
