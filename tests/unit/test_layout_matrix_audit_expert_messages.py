"""The expert-degree refusals name degrees that run (layout matrix audit).

- parallel.expert 8 with 6 experts on 8 ranks was told "valid degrees: [1, 2, 3, 6]": 3 and 6 do not divide the 8
  ranks, and the next try was refused again by job/dims.py (config rules do not know the world size; the message
  now says the degree must divide the ranks too).
- parallel.expert 2 with debug-moe on 6 ranks (an expert-data group of 3, which splits neither dim nor expert_dim)
  was told to "choose parallel.expert among none on this world size", though 1 (no expert parallelism) runs."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout


def _degrees_said(said: str) -> list[int]:
    listed = said.split("[", 1)[1].split("]", 1)[0]
    return [int(x) for x in listed.split(",")]


def test_a_degree_not_dividing_the_experts_names_the_rank_rule_too():
    with pytest.raises(ConfigError) as e:
        load_config("configs/debug.toml", ["--model.preset=debug-moe", "--model.moe.experts=6", "--parallel.expert=8"])
    said = str(e.value)
    assert "and the number of ranks" in said and "also divides the ranks" in said
    # each degree it names divides the experts; the world's own check refuses the ones that do not divide it
    assert all(6 % d == 0 for d in _degrees_said(said))


def test_an_expert_degree_whose_group_splits_no_dim_names_one_that_runs():
    cfg = load_config("configs/debug.toml", ["--model.preset=debug-moe", "--parallel.dp_shard=6", "--parallel.expert=2",
                                             "--train.global_batch=6"])
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 6)
    said = str(e.value)
    assert "none on this world size" not in said
    named = _degrees_said(said.split("Choose parallel.expert among", 1)[1])
    assert named == [1]
    ok = load_config("configs/debug.toml", ["--model.preset=debug-moe", "--parallel.dp_shard=6",
                                            f"--parallel.expert={named[0]}", "--train.global_batch=6"])
    assert check_layout(ok, 6).expert == 1


def test_under_co2_the_degrees_named_are_ones_every_check_accepts():
    """3 co2 replicas of 2 ranks, 6 experts: expert 2 leaves expert-data groups of 3 (dim 128 splits on neither);
    it named [1, 3, 6], and 3 and 6 were then refused by the co2 rule (an expert group must fit in a replica)."""
    args = ["--model.preset=debug-moe", "--model.moe.experts=6", "--parallel.dp_replicate=3", "--parallel.dp_shard=2",
            "--train.data_parallel=co2", "--train.global_batch=6"]
    with pytest.raises(ConfigError) as e:
        check_layout(load_config("configs/debug.toml", [*args, "--parallel.expert=2"]), 6)
    named = _degrees_said(str(e.value).split("Choose parallel.expert among", 1)[1])
    assert named  # (1 at least)
    for degree in named:
        assert check_layout(load_config("configs/debug.toml", [*args, f"--parallel.expert={degree}"]), 6)
