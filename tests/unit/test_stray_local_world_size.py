"""LOCAL_WORLD_SIZE left in the shell that launches (not a launched rank): the preflight's ranks per node
read it as this job's, and a non-number ended in int()'s traceback (`LOCAL_WORLD_SIZE=abc longctx train
--nproc 2`). Outside a launcher every rank runs on this machine; inside one the launcher's value counts."""

import pytest

from longctx.config import load_config
from longctx.job.checks import launcher_node_ranks, ranks_per_node


@pytest.mark.parametrize("stray", ["abc", "3", ""])
def test_the_launching_shell_ignores_a_stray_local_world_size(monkeypatch, stray):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", stray)
    assert ranks_per_node(load_config(None, []), 2) == 2
    assert launcher_node_ranks(4) == 4


def test_a_launched_rank_takes_the_launchers(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(load_config(None, []), 8) == 4
    assert ranks_per_node(load_config(None, ["--parallel.ranks_per_node=2"]), 8) == 2  # (given: it wins)
