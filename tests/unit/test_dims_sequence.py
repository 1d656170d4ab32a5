import pytest
import torch

from longctx.errors import ConfigError
from longctx.job.checks import check_divisible
from longctx.job.dims import ParallelDims
from longctx.parallel.context.ring import Schedule
from longctx.parallel.context.sequence import shard_indices


def test_degrees_multiply_to_world_size_and_one_is_inferred():
    d = ParallelDims(head=2, ctx=2, world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.head, d.ctx) == (1, 2, 2, 2)
    with pytest.raises(ConfigError, match="multiply to 4 .* world size is 8"):
        ParallelDims(dp_shard=1, head=2, ctx=2, world_size=8)
    with pytest.raises(ConfigError, match="not divisible by the product"):
        ParallelDims(head=3, world_size=8)
    with pytest.raises(ConfigError, match="at most one parallel degree may be -1"):
        ParallelDims(dp_shard=-1, ctx=-1, world_size=8)
    with pytest.raises(ConfigError, match="window \\(3\\) must be 0 .* divide parallel.ctx \\(4\\)"):
        ParallelDims(ctx=4, window=3, world_size=4)
    with pytest.raises(ConfigError, match="placement"):
        ParallelDims(placement="random", world_size=1)


def test_placement_decides_which_group_is_adjacent():
    hf = ParallelDims(dp_shard=2, head=2, ctx=2, placement="head-first", world_size=8).rank_grid()
    cf = ParallelDims(dp_shard=2, head=2, ctx=2, placement="ctx-first", world_size=8).rank_grid()
    # head group = vary the head index with the others fixed
    assert hf[0, 0, :, 0].tolist() == [0, 1] and hf[0, 0, 0, :].tolist() == [0, 2]
    assert cf[0, 0, 0, :].tolist() == [0, 1] and cf[0, 0, :, 0].tolist() == [0, 2]
    for grid in (hf, cf):
        assert sorted(grid.flatten().tolist()) == list(range(8))


@pytest.mark.parametrize("ctx, head", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2), (8, 1), (3, 2)])
def test_shards_cover_every_token_once_and_balance_causal_work(ctx, head):
    seq = 2 * ctx * head * 3
    parts = {(i, j): shard_indices(seq, ctx, head, i, j) for i in range(ctx) for j in range(head)}
    allidx = torch.cat(list(parts.values()))
    assert sorted(allidx.tolist()) == list(range(seq))
    # causal work of a context rank = sum over its tokens of (position + 1): equal for all ctx ranks
    work = [sum(int(p) + 1 for j in range(head) for p in parts[(i, j)]) for i in range(ctx)]
    assert len(set(work)) == 1
    # zigzag: context rank i holds chunks i and 2c-1-i
    chunk = seq // (2 * ctx)
    ctx0 = torch.cat([parts[(0, j)] for j in range(head)])
    assert ctx0[:chunk].tolist() == list(range(chunk))
    assert ctx0[chunk:].tolist() == list(range(seq - chunk, seq))


def test_indivisible_sequence_is_a_clear_error():
    with pytest.raises(ConfigError, match="sequence length 100 is not divisible by 2 x ctx x head = 2 x 4 x 2 = 16"):
        check_divisible(100, 4, 2)


@pytest.mark.parametrize("ctx, window", [(8, 2), (8, 4), (8, 8), (8, 1), (4, 2), (6, 3)])
def test_double_ring_schedule_visits_every_block_once(ctx, window):
    for rank in range(ctx):
        s = Schedule(ctx, window, rank)
        sources = [src for _, _, src in s.steps()]
        assert sorted(sources) == list(range(ctx)) and sources[0] == rank
        # inner hops stay inside the window; outer hops keep the position in the window
        assert s.inner_next // window == rank // window
        assert s.outer_next % window == rank % window
    # consistency: what rank r holds at (o, t+1) is what its inner predecessor held at (o, t)
    for rank in range(ctx):
        s = Schedule(ctx, window, rank)
        prev = Schedule(ctx, window, s.inner_prev)
        for o in range(s.windows):
            for t in range(window - 1):
                assert s.source(o, t + 1) == prev.source(o, t)
