"""job/spawn.py's ranks set RANK, WORLD_SIZE and LOCAL_RANK, and since the ranks per node are read in launched
ranks only (job/checks.py launcher_node_ranks), a LOCAL_WORLD_SIZE left in the caller's shell became the ranks'
node size while the caller (the planner's validation, bench memory / comm, outside a launcher) counted every rank
on this machine: they disagreed on the host memory each rank may pin and on hpz / qgz's node. The ranks say
LOCAL_WORLD_SIZE as torchrun does: all of them, on this machine."""

from longctx.job.checks import launcher_node_ranks
from longctx.job.spawn import run_spawned


def test_spawned_ranks_count_every_rank_on_this_machine_despite_a_stray_local_world_size(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # (left in the shell: a torchrun job's, a Slurm step's)
    assert launcher_node_ranks(2) == 2  # the caller's count
    assert run_spawned(2, launcher_node_ranks, 2) == [2, 2]
