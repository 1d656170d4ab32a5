"""parallel.hpz_ranks: hpZ's secondary partition at a smaller level than the node (Frontier's three
levels), checked before launch."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import hpz_group
from longctx.job.dims import ParallelDims


def _group(args, world=8):
    cfg = load_config("configs/debug.toml", ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=4", *args])
    return hpz_group(cfg, ParallelDims.from_config(cfg, world))


def test_the_partition_is_the_node_unless_a_smaller_level_is_named():
    assert _group([]) == 4
    assert _group(["--parallel.hpz_ranks=2"]) == 2


@pytest.mark.parametrize("ranks", [3, -1])
def test_a_level_that_does_not_split_the_node_is_refused(ranks):
    with pytest.raises(ConfigError, match="hpz_ranks"):
        _group([f"--parallel.hpz_ranks={ranks}"])
