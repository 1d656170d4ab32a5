"""parallel.expert_ranks_per_node (hierarchical dispatch), like parallel.expert_replicas (FlexMoE's copies of hot
experts) until the plan costed them (planner/expert_copies.py), acts only under expert parallelism, whose degree
the plan chooses (--expert): given to `longctx plan` it was refused by the base config (expert 1) with "set
parallel.expert > 1", which the plan then refused too ("the plan chooses parallel.expert"): no way through. It was
refused up front while the plan did not cost it; since session 109 it is costed (planner/expert_nodes.py,
tests/unit/test_hier_plan109.py) and taken as a candidate beside the flat exchange."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


ARGS = ["--model", "debug-moe", "--gpus", "4", "--seq-len", "4K", "--hardware", "h100"]


# (parallel.expert_replicas is costed since session 108: tests/unit/test_planrep108.py; expert_ranks_per_node
# since session 109)
def test_the_hierarchical_dispatch_is_taken_by_the_plan_not_refused():
    req, base = build_request(_args(ARGS), ["--parallel.expert_ranks_per_node=2"])
    assert req.expert_ranks_per_node == 2 and base.parallel.expert_ranks_per_node == 0
    with pytest.raises(ConfigError, match="expert_ranks_per_node = 2 .*tries no such expert degree") as e:
        build_request(_args([*ARGS, "--expert", "2"]), ["--parallel.expert_ranks_per_node=2"])
    assert "set parallel.expert > 1" not in str(e.value)  # (the advice the plan itself refuses)


@pytest.mark.parametrize("key", ["expert_replicas", "expert_ranks_per_node"])
def test_the_default_value_still_plans(key):
    req, base = build_request(_args(ARGS), [f"--parallel.{key}=0"])
    assert getattr(base.parallel, key) == 0
