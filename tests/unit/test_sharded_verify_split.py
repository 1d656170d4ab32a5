"""A sharded cache's verification call (generate/sharded.py _partial_masked: a speculative chain's k + 1
queries or a CaPE tree's nodes on one rank's slots) attends the slots held before the call with one
kernel call (grouped queries) and only the call's own few slots with a masked softmax, merged by the
log-sum-exp. Against the plain fp32 softmax over every slot with the full mask (the path it replaced):
chains and trees, ragged rows (some holding none before the call, some keeping none of the new slots),
GQA, a rank keeping none of the call. And it never expands the held slots per query head in fp32."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.generate.sharded import _partial_masked
from longctx.models.cached_attention import CacheStep, masked_attention


def _reference(q, keys, values, before, mine, held, among):
    """The replaced path: one fp32 softmax over every slot with the full [b, n, slots] mask."""
    b, n = q.shape[:2]
    length = int(held.max())
    among = np.tril(np.ones((n, n), dtype=bool)) if among is None else among.numpy()
    visible = np.zeros((b, n, length), dtype=bool)
    for r in range(b):
        visible[r, :, :before[r]] = True
        for m, j in enumerate(np.nonzero(mine[r])[0]):
            visible[r, :, before[r] + m] = among[:, j]
    return masked_attention(q, keys[:, :, :length], values[:, :, :length], torch.as_tensor(visible))


def _case(before, mine, heads=8, kv=2, d=16, capacity=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    before, mine = np.asarray(before), np.asarray(mine, dtype=bool)
    b, n = mine.shape
    held = before + mine.sum(axis=1)
    capacity = capacity or int(held.max()) + 3
    q = torch.randn(b, n, heads, d, generator=g)
    keys, values = torch.randn(b, kv, capacity, d, generator=g), torch.randn(b, kv, capacity, d, generator=g)
    return q, keys, values, before, mine, held


def _tree(n, seed=0):
    """A random tree's ancestor-or-self mask (node 0 the root, each node's parent an earlier node)."""
    rng = np.random.default_rng(seed)
    among = np.eye(n, dtype=bool)
    for j in range(1, n):
        among[j] |= among[rng.integers(0, j)]
    return torch.as_tensor(among)


CASES = {
    "chain, uniform": ([40, 40], [[1, 0, 1, 0, 1], [1, 0, 1, 0, 1]]),
    "chain, ragged": ([40, 7, 0], [[1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [1, 1, 0, 0, 1]]),
    "ragged, a row keeps none": ([12, 12, 30], [[0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]),
    "none held before": ([0, 0], [[1, 0, 1], [0, 1, 1]]),
    "keeps none of the call": ([25, 25], [[0, 0, 0], [0, 0, 0]]),
}


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4), (4, 1)])
def test_split_verification_is_the_full_masked_softmax(name, tree, heads, kv):
    before, mine = CASES[name]
    q, keys, values, before, mine, held = _case(before, mine, heads, kv)
    n = q.shape[1]
    among = _tree(n, seed=n) if tree else None
    step = CacheStep(before.copy(), n, None, among)
    if int(held.max()) == 0:
        return
    want_out, want_lse = _reference(q, keys, values, before, mine, held, among)
    for _ in range(2):  # a second layer of the call reuses the step's indices and mask
        out, lse = _partial_masked(q, keys, values, before, mine, held, step)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


class _Largest(TorchDispatchMode):
    """The largest fp32 output of any op but a view or the attention kernel itself."""

    KERNELS = ("_scaled_dot_product",)

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not any(k in str(func) for k in self.KERNELS):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ragged", [False, True])
def test_verification_never_expands_the_held_slots_in_fp32(ragged, dtype):
    """A bf16 or fp32 cache of 4096 held slots, 8 query heads over 2 kv heads, 5 queries: nothing outside the kernel
    is as large as [heads, queries, slots] fp32 (it was, and [heads, slots, d] fp32 for K and V)."""
    slots, heads, n, d = 4096, 8, 5, 16
    before = [slots, slots] if not ragged else [slots, slots - 100]
    mine = [[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]]
    q, keys, values, before, mine, held = _case(before, mine, heads, 2, d)
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    step = CacheStep(before.copy(), n, None, None)
    with _Largest() as probe:
        _partial_masked(q, keys, values, before, mine, held, step)
    # nothing grows with the slots: [b, n, h, d] outputs, the call's own <= n slots per query head
    assert probe.largest < slots, probe.largest  # (the replaced path: [b, h, slots, d] fp32 K and V, 262K floats)
