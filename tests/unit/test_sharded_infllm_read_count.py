"""The sharded InfLLM cache's `keys_read` (the most keys one call read on a rank, which
tests/distributed/test_sharded_infllm.py holds against one process's) counts the calls made through
its rows() views too: prefill runs through them, and their reads were lost with the view."""

import numpy as np
import torch

from longctx.generate.sharded_infllm import ShardedInfLLMCache


def _cache():
    cache = object.__new__(ShardedInfLLMCache)
    cache.k = cache.v = torch.zeros(1, 2, 1, 8, 4)
    cache.reps = torch.zeros(1, 2, 3, 1, 4)
    cache.lengths = np.zeros(2, dtype=np.int64)
    cache._keys_read = [0]  # (as __init__ makes them)
    cache.keys_read = 0
    return cache


def test_reads_through_a_view_count_on_the_cache():
    cache = _cache()
    view = cache.rows(0, 1)
    view.keys_read = max(view.keys_read, 40)  # as a prefill call's attention records it
    assert cache.keys_read == 40
    cache.keys_read = max(cache.keys_read, 12)  # a later decode call reads fewer: the most stays
    assert cache.keys_read == 40 and cache.rows(0, 2).keys_read == 40
