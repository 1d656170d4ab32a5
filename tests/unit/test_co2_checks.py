"""train.data_parallel = co2's bad input: each problem one clear error before launch, naming the fix."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError

CO2 = ["--train.data_parallel=co2", "--parallel.dp_replicate=2"]


@pytest.mark.parametrize("args,says", [
    (["--train.data_parallel=co2"], "set parallel.dp_replicate"),
    ([*CO2, "--train.co2_local_steps=0"], "train.co2_local_steps must be at least 1"),
    ([*CO2, "--train.co2_outer_lr=0"], "train.co2_outer_lr must be positive"),
    ([*CO2, "--train.co2_sync_steps=300"], "train.co2_sync_steps must be in [0, train.steps = 300)"),
    ([*CO2, "--train.co2_sync_steps=-1"], "train.co2_sync_steps must be in"),
    ([*CO2, "--train.co2_overlap_steps=5"], "train.co2_overlap_steps must be in 1..train.co2_local_steps = 4"),
    ([*CO2, "--train.co2_outer_momentum=1"], "train.co2_outer_momentum must be in [0, 1)"),
    ([*CO2, "--train.co2_staleness_penalty=-1"], "train.co2_staleness_penalty must be >= 0"),
    ([*CO2, "--memory.model_states=host"], "use memory.model_states = device"),
    ([*CO2, "--train.on_nonfinite=rollback"], "use skip or stop"),
])
def test_each_problem_is_one_clear_error(args, says):
    with pytest.raises(ConfigError, match="co2") as e:
        load_config("configs/debug.toml", args)
    assert says in str(e.value)


def test_a_sound_co2_config_and_sync_are_accepted():
    cfg = load_config("configs/debug.toml", [*CO2, "--train.co2_outer_momentum=0.5", "--parallel.zero_pp=hpz,qwz,qgz",
                                             "--train.co2_sync_steps=299", "--train.co2_overlap_steps=4"])
    assert cfg.train.data_parallel == "co2" and cfg.train.co2_local_steps == 4
    assert load_config("configs/debug.toml", ["--train.co2_local_steps=0"]).train.data_parallel == "sync"


def test_experts_spread_over_more_ranks_than_a_replica_holds_are_refused_before_launch():
    """co2 replicas keep their own weights: an expert degree spanning replicas crashed at set-up (a division
    by zero in the FSDP volumes), and would have mixed replicas' experts."""
    from longctx.job.checks import check_layout

    cfg = load_config(None, ["--model.preset=debug-moe", *CO2, "--parallel.expert=2", "--train.global_batch=4"])
    with pytest.raises(ConfigError, match=r"choose parallel.expert among \[1\]"):
        check_layout(cfg, 2)
    assert check_layout(cfg, 4).expert == 2  # two replicas of 2 ranks: the experts within each
