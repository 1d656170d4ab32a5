"""Gradient buckets (parallel/fsdp/grad_buckets.py): the lane simulation against hand-worked timelines,
the plan's choices where latency or the tail dominates, and the plan a run gets from its config."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.parallel.fsdp.grad_buckets import (
    BucketPlan,
    bucket_sizes,
    exposed_seconds,
    grad_reduce_figures,
    plan_buckets,
    plan_for,
)


def test_bucket_sizes_put_the_remainder_at_block_0():
    assert bucket_sizes(8, 1) == (1,) * 8
    assert bucket_sizes(8, 3) == (2, 3, 3)
    assert bucket_sizes(8, 8) == (8,)
    assert [list(g) for g in BucketPlan((2, 3, 3), "x", None, None).groups()] == [[0, 1], [2, 3, 4], [5, 6, 7]]


def test_exposed_time_follows_the_lane_by_hand():
    # backward 1 s per block, 0.5 s of bytes per block, 0.1 s per collective
    # (1, 1): top bucket ready at 1, lane 1 -> 1.6; block 0 ready at 2, lane 2 -> 2.6: 0.6 left
    assert exposed_seconds((1, 1), 1.0, 0.5, 0.1) == pytest.approx(0.6)
    # (2,): ready at 2, lane 2 -> 3.1
    assert exposed_seconds((2,), 1.0, 0.5, 0.1) == pytest.approx(1.1)
    # transfers slower than the backward queue up: 1 -> 3, then 3 -> 5 while the backward ends at 2
    assert exposed_seconds((1, 1), 1.0, 2.0, 0.0) == pytest.approx(3.0)
    # no overlap (gloo on a CPU): every transfer blocks
    assert exposed_seconds((1, 1), 1.0, 0.5, 0.1, overlap=False) == pytest.approx(1.2)
    assert exposed_seconds((2,), 1.0, 0.5, 0.1, overlap=False) == pytest.approx(1.1)


def test_the_plan_trades_latency_against_the_tail():
    # big blocks, small latency: one block per bucket leaves the shortest tail
    assert plan_buckets(16, 1.0, 0.2, 1e-5).sizes == (1,) * 16
    # latency-bound (tiny blocks, a collective costs more than a block's backward): bigger buckets
    latency_bound = plan_buckets(16, 1e-4, 1e-6, 1e-3)
    assert latency_bound.sizes[-1] > 1 and latency_bound.exposed_s < exposed_seconds((1,) * 16, 1e-4, 1e-6, 1e-3)
    # without overlap the fewest collectives win, up to the cap (a quarter of the blocks)
    assert plan_buckets(16, 1.0, 0.2, 1e-3, overlap=False).sizes == (4, 4, 4, 4)
    assert plan_buckets(16, 1.0, 0.2, 1e-3, overlap=False, max_per_bucket=8).sizes == (8, 8)
    assert plan_buckets(2, 1.0, 0.2, 1e-3, overlap=False).sizes == (1, 1)


def test_a_run_gets_its_plan_from_the_config():
    m = load_config(None, ["--model.preset=small-moe"]).model
    fixed = plan_for(m, 3, 4096, 4096, 4, 1, "cpu")
    assert fixed.sizes == (2, 3, 3) and fixed.chosen_by == "parallel.grad_bucket_blocks"
    assert "3 reduce-scatters" in fixed.describe()
    cpu = plan_for(m, 0, 4096, 4096, 4, 1, "cpu")
    assert cpu.sizes == (2, 2, 2, 2) and "CPU" in cpu.chosen_by  # 8 blocks, a quarter per bucket
    assert plan_for(m, 100, 4096, 4096, 4, 1, "cpu").sizes == (8,)
    with pytest.raises(ConfigError, match="grad_bucket_blocks"):
        load_config(None, ["--parallel.grad_bucket_blocks=-1"])


def test_the_figures_are_per_step():
    class Timer:
        def take(self):
            return 6, 600, 0.3

    assert grad_reduce_figures([Timer(), Timer()], 3) == {"grad_reduce_calls": 4.0, "grad_reduce_bytes": 400.0,
                                                           "grad_reduce_exposed_s": pytest.approx(0.2)}
    assert grad_reduce_figures([], 3) == {}
