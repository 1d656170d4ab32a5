"""A layout whose expert-data group (world / parallel.expert ranks) divides neither model.dim nor
model.moe.expert_dim: FSDP2 cannot shard a rank's experts over it (it splits an inner dim only evenly), and
raised "does not support uneven sharding on dim 1" inside every rank's set-up. Now refused before launch with the
degrees that work, never proposed by the planner, and refused when named to it
(tests/distributed/test_expert_shard_dims.py trains the layouts that are accepted)."""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.planner.request import Request, expert_degrees

SIX = ["--model.preset=debug-moe", "--parallel.dp_shard=6", "--parallel.expert=2", "--train.global_batch=6"]


def test_a_group_that_divides_no_inner_dim_is_refused_before_launch():
    cfg = load_config("configs/debug.toml", SIX)  # expert-data groups of 3 ranks; dim 128, expert_dim 128
    with pytest.raises(ConfigError, match=r"leaves 3 ranks holding the same experts.*3 divides neither"):
        check_layout(cfg, 6)


@pytest.mark.parametrize("extra", [["--model.moe.expert_dim=96"],  # w1, w3 on dim 1; w2 on dim 2
                                   ["--parallel.expert=1"],        # no expert groups: FSDP over all 6 ranks
                                   ["--parallel.dp_shard=4", "--train.global_batch=4"]])  # groups of 2
def test_layouts_fsdp_can_split_pass(extra):
    cfg = load_config("configs/debug.toml", [*SIX, *extra])
    check_layout(cfg, cfg.parallel.dp_shard)


def test_the_planner_proposes_no_such_degree_and_refuses_one_named():
    m = load_config(None, {"model": {"preset": "debug-moe"}}).model
    # 6 GPUs: 2 divides the 8 experts and the GPUs, but leaves groups of 3
    assert expert_degrees(Request(m, PRESETS["h100"], 6, 4096)) == (1,)
    assert expert_degrees(Request(m, PRESETS["h100"], 4, 4096, gpus_per_node=4)) == (1, 4)
    with pytest.raises(ConfigError, match=r"expert-data groups \(3 GPUs\) that divide neither"):
        Request(m, PRESETS["h100"], 6, 4096, expert_degrees=(2,))
