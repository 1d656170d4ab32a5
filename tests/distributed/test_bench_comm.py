"""`longctx bench comm --cluster` (bench/comm_cluster.py): every slow-link mode on an emulated 2 x 2
cluster. The bytes each rank put on a hop across / inside nodes, as the emulated links counted them,
equal the closed forms of bench/comm_bytes.py (derived from the parameters' shapes, not from the
counts) exactly; ZeRO++'s three together send at most 0.3x plain FSDP's bytes across nodes, and co2
sends its outer all-reduce once a round. Timings are reported, never asserted."""

import argparse
import json

import pytest

from longctx.bench import comm_cluster
from longctx.bench.comm_bytes import Unit, step_bytes
from longctx.errors import ConfigError

# 5 steps (were 6): the fewest the bench takes (co2's warm-up of one round, 2 timed steps and one more)
STEPS = 5


@pytest.fixture(scope="module")
def report():
    import contextlib
    import io

    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    args = p.parse_args(["--cluster", "2x2", "--timed", "2", "--co2-local-steps", "2", "--steps", str(STEPS)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert comm_cluster.main(args) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("mode", [m for m in comm_cluster.MODES if m != "three_level"])
def test_bytes_per_step_equal_the_closed_form(report, mode):
    r = report["modes"][mode]
    assert r["inter_node_bytes"] == r["closed_form"]["inter_node_bytes"] > 0
    assert r["intra_node_bytes"] == r["closed_form"]["intra_node_bytes"] > 0
    assert r["step_s"] > 0 and 0 <= r["exposed_s"] <= r["step_s"]


def test_zero_pp_crosses_nodes_with_under_a_third_of_fsdp_bytes(report):
    modes = report["modes"]
    assert modes["zeropp"]["inter_node_bytes"] <= 0.3 * modes["fsdp"]["inter_node_bytes"]
    for one in ("hpz", "qwz", "qgz"):  # each alone saves some, all three the most
        assert modes["zeropp"]["inter_node_bytes"] < modes[one]["inter_node_bytes"] < modes["fsdp"]["inter_node_bytes"]


def test_every_mode_trains_from_the_same_start(report):
    first = {m: r["losses"][0] for m, r in report["modes"].items()}
    assert first["hpz"] == pytest.approx(first["fsdp"], abs=1e-6)  # exact modes agree on the same data
    assert first["co2"] == pytest.approx(first["fsdp"], abs=1e-5)  # (no round has ended at step 1)
    for r in report["modes"].values():
        assert len(r["losses"]) == STEPS and r["final_loss"] < r["losses"][0]


def test_the_closed_form_counts_what_each_mode_moves():
    """The forms by hand on a toy of 2 nodes x 2 ranks: one block unit of 8 elements per rank (16 per rank
    of a node's group) and a root of 4: fsdp runs 3 ring collectives of the block and 2 of the root, each
    crossing nodes at 2 of the ring's 4 hops; hpz moves the backward's gather into the nodes."""
    units = [Unit(8, 16), Unit(4, 8, root=True)]
    fsdp = step_bytes("fsdp", units, 2, 2)
    ring = lambda elements: 4 * elements * 3  # noqa: E731  (each of 4 ranks sends (4 - 1) shares)
    loss = 2 * 8 * 3 // 4
    assert fsdp["inter_node_bytes"] == 2 * (3 * ring(8) + 2 * ring(4) + loss)
    assert fsdp["intra_node_bytes"] == 2 * (3 * ring(8) + 2 * ring(4) + loss)
    hpz = step_bytes("hpz", units, 2, 2)
    node_ring = 4 * 16 * 1  # a node's 2 ranks each send their one other share of the 16-element node shard
    assert hpz["inter_node_bytes"] == fsdp["inter_node_bytes"] - 2 * ring(8)
    assert hpz["intra_node_bytes"] == fsdp["intra_node_bytes"] - 2 * ring(8) + 4 * node_ring


@pytest.mark.slow
def test_three_levels_count_exactly_and_keep_backward_gathers_in_the_group():
    """2 nodes x 2 groups x 2 ranks: three_level (zeropp, hpZ's partition a group) against zeropp (a node)."""
    import contextlib
    import io

    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    args = p.parse_args(["--cluster", "2x4", "--group-ranks", "2", "--modes", "fsdp,zeropp,three_level",
                         "--timed", "2", "--co2-local-steps", "2", "--steps", "4", "--zero-pp-kernels", "eager"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert comm_cluster.main(args) == 0
    modes = json.loads(out.getvalue())["modes"]
    for r in modes.values():
        for key in ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes"):
            assert r[key] == r["closed_form"][key] > 0
    three, zeropp = modes["three_level"], modes["zeropp"]
    assert three["inter_node_bytes"] == zeropp["inter_node_bytes"]  # the same across nodes
    middle = lambda r: r["intra_node_bytes"] - r["intra_group_bytes"]  # noqa: E731  between a node's groups
    assert middle(three) < middle(zeropp) and three["intra_group_bytes"] > zeropp["intra_group_bytes"]
    # where backward reads the weights from changes, not what it reads: the same losses
    assert max(abs(a - b) for a, b in zip(three["losses"], zeropp["losses"])) < 1e-6


def test_bad_three_level_requests_are_refused():
    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    for argv, says in ((["--cluster", "2x4", "--modes", "three_level"], "needs a third link level"),
                       (["--cluster", "2x4", "--group-ranks", "3"], "must split a node"),
                       (["--cluster", "1x4"], "at least 2 nodes")):
        with pytest.raises(ConfigError, match=says):
            comm_cluster.main(p.parse_args(argv))
