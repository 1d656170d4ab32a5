"""co2 with hpz over part of a replica is refused before launch (layout matrix audit).

Under co2 each replica is an FSDP group of its own; FSDP2 builds hpz's post-forward mesh from the replica's ranks
inside fully_shard, a new_group the other replicas never join: 8 ranks as 2 replicas of 4 with nodes of 2 passed
every check and then hung in every rank's set-up (_get_post_forward_mesh_info on some ranks, the metrics'
broadcast on others). The secondary partitions that build no mesh (1 rank, the whole replica) and sync HSDP
(its mesh holds every rank) stay accepted."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout

CO2 = ["--train.data_parallel=co2", "--parallel.dp_replicate=2", "--parallel.dp_shard=4", "--train.global_batch=8",
       "--parallel.zero_pp=hpz"]


def _check(args, world=8):
    return check_layout(load_config("configs/debug.toml", args), world)


@pytest.mark.parametrize("args", [["--parallel.ranks_per_node=2"],
                                  ["--parallel.ranks_per_node=4", "--parallel.hpz_ranks=2"]])
def test_hpz_over_part_of_a_co2_replica_is_refused_with_the_values_that_work(args):
    with pytest.raises(ConfigError) as e:
        _check([*CO2, *args])
    said = str(e.value)
    assert "hpz over 2 ranks" in said and "its own 4 ranks" in said
    assert "parallel.ranks_per_node 4 with parallel.hpz_ranks 0" in said and "sync" in said


@pytest.mark.parametrize("args", [["--parallel.ranks_per_node=4"],
                                  ["--parallel.ranks_per_node=4", "--parallel.hpz_ranks=1"],
                                  ["--parallel.ranks_per_node=1"]])
def test_hpz_that_builds_no_mesh_under_co2_is_accepted(args):
    assert _check([*CO2, *args]).dp_replicate == 2


def test_sync_hsdp_with_hpz_over_part_of_the_group_is_accepted():
    sync = [a for a in CO2 if not a.startswith("--train.data_parallel")]
    assert _check([*sync, "--parallel.ranks_per_node=2"]).dp_shard == 4
