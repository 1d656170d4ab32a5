"""bench comm's closed forms of the bytes per step on each link level (costs/link_bytes.py step_bytes and
layout_bytes, from the FSDP units' shapes) and the planner's figures (planner/slow_links.py link_level_bytes,
from the model config alone) against the Trainer's real step on 2 nodes x 2 ranks: plain FSDP over every rank,
hpz, qwz, qgz, all three, co2 (a replica per node) and HSDP (2 replicas of a node each). The bytes are
counted by tests/link_audit.py RawLinks from the c10d operators, whoever issued them, each transfer booked on
the hop it takes (a ring's successor, an all-to-all's peer) - not by the emulated links' own count
(tests/distributed/test_bench_comm.py), which is job/comm.py's."""

import pytest

from link_audit import trainer_links
from longctx.bench.comm_bytes import step_bytes
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.link_bytes import layout_bytes
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.planner.slow_links import link_level_bytes

pytestmark = pytest.mark.slow  # one 4-rank job of 7 short runs: ~40 s on a 2-core CPU

NODES, RANKS = 2, 2
RUNS = [("fsdp", 1), ("hpz", 1), ("qwz", 1), ("qgz", 1), ("zeropp", 1), ("co2", 1), ("fsdp", 2)]
LEVELS = ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("links"))
    return run_spawned(NODES * RANKS, trainer_links, NODES, RANKS, RUNS, work)


def closed_form(mode: str, replicas: int, got: dict) -> dict:
    if replicas > 1:
        return layout_bytes("fsdp", got["units"], NODES, RANKS, replicas)
    return step_bytes(mode, got["units"], NODES, RANKS, got["block"], local_steps=2)


def planner_form(mode: str, replicas: int) -> dict | None:
    model = load_config(None, ["--model.preset=debug"]).model
    world = NODES * RANKS
    shape = {"fsdp": MeshShape(replicas, world // replicas),
             "zeropp": MeshShape(1, world, zero_pp="hpz,qwz,qgz", node=RANKS),
             "co2": MeshShape(NODES, RANKS, data_parallel="co2", local_steps=2)}.get(mode)
    hw = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")  # fp32 gathers, as on the CPU
    return None if shape is None else link_level_bytes(model, shape, hw, RANKS)


@pytest.mark.parametrize("mode,replicas", RUNS, ids=[f"{m}-{r}" for m, r in RUNS])
def test_each_link_level_carries_the_closed_forms_bytes(counted, mode, replicas):
    got = counted[0][f"{mode}-{replicas}"]
    assert got["unknown"] == []
    expected = closed_form(mode, replicas, got)
    assert {k: got[k] for k in LEVELS} == {k: float(expected[k]) for k in LEVELS}
    assert got["inter_node_bytes"] > 0 and got["intra_node_bytes"] > 0


@pytest.mark.parametrize("mode,replicas", [("fsdp", 1), ("zeropp", 1), ("co2", 1), ("fsdp", 2)])
def test_the_planners_link_levels_are_the_counted_bytes(counted, mode, replicas):
    got = counted[0][f"{mode}-{replicas}"]
    assert planner_form(mode, replicas) == {k: int(got[k]) for k in LEVELS}


def test_the_metrics_lines_fsdp_bytes_are_what_each_rank_sent(counted):
    """The training loop's metrics line reports FSDP's bytes per rank and step (plain FSDP and HSDP here)."""
    for name in ("fsdp-1", "fsdp-2"):
        for rank in counted:
            assert rank[name]["metrics_fsdp"] == rank[name]["rank_fsdp"] > 0


def test_zero_pp_moves_the_inter_node_bytes_its_parts_promise(counted):
    """Each part on its own link: hpz takes backward's gathers off the inter-node hops (two of fsdp's three
    block passes there become one), qwz sends a quarter and the scales, qgz's inter-node all-to-all a node's
    share of int8 rows; together under 0.3 x fsdp's inter-node bytes."""
    inter = {name: r["inter_node_bytes"] for name, r in counted[0].items()}
    for part in ("hpz-1", "qwz-1", "qgz-1"):
        assert inter["zeropp-1"] < inter[part] < inter["fsdp-1"]
    assert inter["zeropp-1"] < 0.3 * inter["fsdp-1"]
    assert inter["co2-1"] < inter["fsdp-2"] < inter["fsdp-1"]  # co2: 1 / H of HSDP's replica all-reduce
