"""parallel.spawn.run_spawned_many: several functions, in order, in one spawned job (2 gloo ranks)."""

import pytest
import torch
import torch.distributed as dist

from longctx.job import comm
from longctx.job.spawn import run_spawned_many


def _sum_of_ranks(n):
    """(comm's counters when the function starts, the sum over ranks of rank + n, its bytes counted)."""
    before = comm.counters()
    t = torch.tensor([float(dist.get_rank() + n)])
    comm.all_reduce(t, comm.world_mesh(), label="test")
    return before, t.item(), comm.counters()["world"]["test"]


def _fails():
    raise ValueError("on purpose")


def test_jobs_run_in_order_by_key_and_rank():
    seconds = {}
    out = run_spawned_many(2, [("a", _sum_of_ranks, (1,)), ("b", _sum_of_ranks, [10]), ("rank", dist.get_rank, ())],
                           seconds=seconds)
    assert list(out) == ["a", "b", "rank"] and list(seconds) == ["a", "b", "rank"]
    assert out["rank"] == [0, 1]
    assert [r[1] for r in out["a"]] == [3.0, 3.0] and [r[1] for r in out["b"]] == [21.0, 21.0]
    # every function starts with the byte counters cleared, as in a fresh process: b's are b's alone
    assert [r[0] for r in out["a"] + out["b"]] == [{}] * 4
    assert [r[2] for r in out["a"] + out["b"]] == [4] * 4  # 2 (n-1)/n of 4 bytes


def test_a_failing_job_is_named_and_keys_are_distinct():
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 2 failed.*ValueError: on purpose.*job 'bad' failed"):
        run_spawned_many(2, [("fine", dist.get_rank, ()), ("bad", _fails, ())])
    with pytest.raises(ValueError, match="distinct"):
        run_spawned_many(2, [("a", dist.get_rank, ()), ("a", dist.get_rank, ())])
