"""The sharded InfLLM cache's local span (generate/sharded_infllm.py _Layer._span) attends the slots of
positions before the call with one kernel call (queries grouped per kv head, no mask) and only the call's
own slots kept on the rank with a masked softmax, merged by the log-sum-exp; a decode token's span is one
kernel call. Its far part (_far) attends rows holding different numbers of their chosen slots run by run,
unmasked. Both against the paths they replaced (one fp32 softmax over every slot with a [b, n, L] mask,
kept here as the reference), in fp32 to 1e-6: decode and prefill-chunk calls, batch 1 and 2, a span from
position 0 and one after the memory units, ranks 0 and 1 of ctx 2 (slots dealt by unit) and ctx 1. And
neither expands the span's keys per query head in fp32."""

import math

import numpy as np
import pytest
import torch

from longctx.generate import sharded_infllm
from longctx.generate.sharded_infllm import ShardedInfLLMCache, _empty, _Layer, owners
from longctx.models.cached_attention import CacheStep, masked_attention
from longctx.models.context_memory import InfLLMShape, rotate
from probes import LargestOutput

SHAPE = InfLLMShape(block=16, repr=2, topk=3, window=64, init=8)


def _old_span(layer, q, lo, end, query_pos):
    """The replaced _span, verbatim: one fp32 softmax over every slot of [lo, end) with a [b, n, L] mask."""
    c = layer.cache
    held = c.slots(lo, end)
    keys, values = c.k[layer.index][:, :, held], c.v[layer.index][:, :, held]
    if keys.shape[2] == 0:
        return _empty(q)
    key_pos = torch.as_tensor(c.positions[held], device=q.device)
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [b, n, L]
    return masked_attention(q, keys, values, visible)


def _old_far_tail(layer, q_far, slots):
    """The replaced end of _far: rows' chosen slots padded with slot 0, masked out, one fp32 softmax."""
    c, b = layer.cache, q_far.shape[0]
    count = max(len(x) for x in slots)
    valid = np.zeros((b, count), dtype=bool)
    padded = np.zeros((b, count), dtype=np.int64)
    for r, x in enumerate(slots):
        valid[r, :len(x)], padded[r, :len(x)] = True, x
    gather = torch.as_tensor(padded)[:, None, :, None].expand(b, c.k.shape[2], count, c.k.shape[4])
    far_k, far_v = c.k[layer.index].gather(2, gather), c.v[layer.index].gather(2, gather)
    far_k = rotate(far_k.transpose(1, 2), -torch.as_tensor(c.positions[padded]), c.inv_freq).transpose(1, 2)
    visible = torch.as_tensor(valid)[:, None, :].expand(b, q_far.shape[1], count)
    return masked_attention(q_far, far_k, far_v, visible)


def _cache(ctx, rank, start, new, batch, heads=8, kv=2, d=16, dtype=torch.float32, shape=SHAPE, seed=0):
    """One layer of a rank's cache holding `start` tokens of every row, about to take `new` (their keys
    already written, as attend() writes them before _span)."""
    g = torch.Generator().manual_seed(seed)
    c = object.__new__(ShardedInfLLMCache)
    everything = np.arange(start + new + 2 * shape.block)
    c.shape, c.c, c.rank, c._keys_read, c.mesh = shape, ctx, rank, [0], None
    c.positions = everything[owners(everything, shape, ctx) == rank]
    c.k, c.v = (torch.randn(1, batch, kv, len(c.positions), d, generator=g).to(dtype) for _ in range(2))
    c.inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    c.reps = torch.zeros(1, batch, len(everything) // shape.block + 1, kv, d)
    c.lengths = np.full(batch, start)
    c.step = CacheStep(np.full(batch, start), new, torch.arange(start, start + new).expand(batch, new))
    q = torch.randn(batch, new, heads, d, generator=g).to(dtype)
    return _Layer(c, 0), q


def _lo(start, new, shape=SHAPE):
    """attend()'s start of the span: 0 before any unit exists, else the end of the units."""
    end = start + new
    init = min(shape.init, end)
    units = max(0, (end - shape.window - init) // shape.block)
    return init + units * shape.block if units else 0


# (start, new): decode and prefill chunks (window / 2), the span from 0 (no unit yet) and after the units;
# a call inside one unit (ctx 2: one rank keeps all of it, the other none), a call of the initial tokens only
CALLS = [(0, 5), (20, 1), (20, 7), (300, 1), (300, 5), (301, 32), (330, 3), (2, 4)]
RANKS = [(1, 0), (2, 0), (2, 1)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ctx,rank", RANKS, ids=["ctx1", "ctx2rank0", "ctx2rank1"])
@pytest.mark.parametrize("start,new", CALLS)
def test_span_is_the_full_masked_softmax(start, new, ctx, rank, batch):
    layer, q = _cache(ctx, rank, start, new, batch)
    lo, end = _lo(start, new), start + new
    assert (lo > 0) == (start >= 300)
    want_out, want_lse = _old_span(layer, q, lo, end, layer.cache.step.positions)
    for _ in range(2):  # a second layer of the call reuses the step's indices and mask
        out, lse = layer._span(q, lo, end)
        torch.testing.assert_close(out.float(), want_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    assert layer.cache.keys_read == layer.cache.slots(lo, end).stop - layer.cache.slots(lo, end).start


@pytest.mark.parametrize("new", [1, 5])
def test_span_in_bf16_is_the_fp32_formula_to_bf16(new):
    """A bf16 cache: the held part's output is rounded to bf16 once (as one process's decode is)."""
    layer, q = _cache(2, 1, 300, new, 2, dtype=torch.bfloat16)
    lo, end = _lo(300, new), 300 + new
    want_out, want_lse = _old_span(layer, q, lo, end, layer.cache.step.positions)
    out, lse = layer._span(q, lo, end)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("new", [1, 5])
def test_span_never_expands_its_keys_in_fp32(new, dtype):
    """A span of 2,100 slots, 8 query heads over 2 kv heads: no fp32 tensor but a view of the cache or the
    kernel's own grows with the span (the replaced path made [b, heads, L, d] fp32 K and V and
    [b, heads, n, L] fp32 scores: 270K floats)."""
    shape = InfLLMShape(block=64, repr=2, topk=3, window=2048, init=8)
    start = 8 + 40 * 64 + 2048 + 60 - new
    layer, q = _cache(1, 0, start, new, 1, dtype=dtype, shape=shape)
    lo, end = _lo(start, new, shape), start + new
    span = end - lo
    assert span > 2048

    cached = {layer.cache.k.untyped_storage().data_ptr(), layer.cache.v.untyped_storage().data_ptr()}

    def made(t):  # an fp32 tensor an op made: not the cache or a view of it
        return t.dtype == torch.float32 and t.untyped_storage().data_ptr() not in cached

    with LargestOutput(made) as probe:
        layer._span(q, lo, end)
    assert probe.largest < span, probe.largest


@pytest.mark.parametrize("batch", [1, 2])
def test_far_rows_of_different_counts_are_the_masked_softmax(batch, monkeypatch):
    """Rank 1 of ctx 2; rows choosing units that lie on it in different numbers (row 1: none but the
    padding), or one count: the far part as the replaced masked fp32 softmax."""
    start = 300
    layer, q = _cache(2, 1, start, 1, batch)
    c, units, init = layer.cache, (start + 1 - SHAPE.window - SHAPE.init) // SHAPE.block, SHAPE.init
    chosen = torch.tensor([[1, 3, 5], [0, 2, 4]])[:batch]  # odd units lie on rank 1
    monkeypatch.setattr(sharded_infllm, "top_units", lambda scores, k: chosen)
    monkeypatch.setattr(sharded_infllm.comm, "all_reduce", lambda t, *a, **k: t)
    query_pos = c.step.positions
    out, lse = layer._far(q, query_pos, units, init)
    slots = [np.concatenate([np.arange(s.start, s.stop) for s in [c.slots(0, init)] + [
        c.slots(init + u * SHAPE.block, init + (u + 1) * SHAPE.block) for u in row]]) for row in chosen.tolist()]
    want_out, want_lse = _old_far_tail(layer, rotate(q, SHAPE.far - query_pos, c.inv_freq), slots)
    torch.testing.assert_close(out.float(), want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.nan_to_num(lse, neginf=0.0), torch.nan_to_num(want_lse, neginf=0.0),
                               atol=1e-6, rtol=1e-6)
    if batch == 2:
        assert math.isinf(lse[1].max().item()) and lse[1].max() < 0  # row 1 holds none here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_far_rows_of_different_counts_never_expand_per_query_head(dtype, monkeypatch):
    """Rows holding 2 and 1 of their chosen units here: no fp32 tensor as large as the gathered keys per
    query head ([b, heads, G, d]: the replaced path's K and V); turning the gathered keys back to position
    0 ([b, G, kv_heads, d] fp32) is the most there is."""
    shape = InfLLMShape(block=64, repr=2, topk=3, window=256, init=8)
    start, heads, kv, d = 8 + 20 * 64 + 256 + 10, 8, 2, 16
    layer, q = _cache(2, 1, start, 1, 2, heads, kv, d, dtype=dtype, shape=shape)
    c, units = layer.cache, (start + 1 - shape.window - shape.init) // shape.block
    monkeypatch.setattr(sharded_infllm, "top_units", lambda scores, k: torch.tensor([[1, 3, 4], [0, 2, 5]]))
    monkeypatch.setattr(sharded_infllm.comm, "all_reduce", lambda t, *a, **k: t)
    cached = {c.k.untyped_storage().data_ptr(), c.v.untyped_storage().data_ptr()}
    with LargestOutput(lambda t: t.dtype == torch.float32 and t.untyped_storage().data_ptr() not in cached) as probe:
        layer._far(q, c.step.positions, units, shape.init)
    gathered = 2 * shape.block  # G: row 0's two units on rank 1 (units 1 and 3; row 1 holds unit 5)
    assert probe.largest <= 2 * gathered * kv * d < 2 * heads * gathered * d, probe.largest
