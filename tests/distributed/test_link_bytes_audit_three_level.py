"""Three link levels (Frontier's groups inside a node) on 2 nodes x 2 groups x 2 ranks: zeropp (hpz's
secondary partition a node) and three_level (a group, parallel.hpz_ranks = 2) put on each level, across nodes,
between a node's groups and inside a group, the bytes of bench comm's closed forms (costs/link_bytes.py
step_bytes) and of the planner (planner/slow_links.py link_level_bytes, hardware.group_ranks = 2), counted by
tests/link_audit.py RawLinks from the c10d operators (see test_link_bytes_audit_links.py)."""

import pytest

from link_audit import trainer_links
from longctx.bench.comm_bytes import step_bytes
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.planner.slow_links import link_level_bytes

pytestmark = pytest.mark.slow  # one 8-rank job of 2 short runs: ~40 s on a 2-core CPU

NODES, RANKS, GROUP = 2, 4, 2
MODES = ("zeropp", "three_level")
LEVELS = ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("three"))
    return run_spawned(NODES * RANKS, trainer_links, NODES, RANKS, [(m, 1) for m in MODES], work, GROUP)[0]


@pytest.mark.parametrize("mode", MODES)
def test_each_of_three_levels_carries_the_closed_forms_and_the_planners_bytes(counted, mode):
    got = counted[f"{mode}-1"]
    hpz = GROUP if mode == "three_level" else 0
    closed = step_bytes(mode, got["units"], NODES, RANKS, got["block"], group=GROUP, hpz_ranks=hpz)
    assert {k: got[k] for k in LEVELS} == {k: float(closed[k]) for k in LEVELS}
    hw = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test", group_ranks=GROUP, middle_gbps=100.0)
    shape = MeshShape(1, NODES * RANKS, zero_pp="hpz,qwz,qgz", node=RANKS, hpz_ranks=hpz)
    planner = link_level_bytes(load_config(None, ["--model.preset=debug"]).model, shape, hw, RANKS)
    assert planner == {k: int(got[k]) for k in LEVELS}


def test_three_level_moves_backwards_gathers_into_the_groups(counted):
    zeropp, three = counted["zeropp-1"], counted["three_level-1"]
    assert three["inter_node_bytes"] == zeropp["inter_node_bytes"]
    assert three["intra_group_bytes"] > zeropp["intra_group_bytes"]
    assert three["intra_node_bytes"] - three["intra_group_bytes"] < \
        zeropp["intra_node_bytes"] - zeropp["intra_group_bytes"]
