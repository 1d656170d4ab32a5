"""The planner's bytes per rank (planner/cost.py estimate's comm_bytes: FSDP's, ZeRO++'s hpz, HSDP's replica
all-reduce, the router statistics' all-reduce, the Ulysses all-to-alls, the ring's K/V passes, the expert
all-to-alls) against what a real step
sends on 2 and 4 gloo ranks, counted by tests/link_audit.py RawLinks from the c10d operators themselves
(whoever issued them), not by job/comm.py's counters, which are checked against the same count."""

import pytest

from link_audit import by_op, collective_bytes, layout_config, layout_traffic, planner_bytes
from longctx.job.spawn import run_spawned

pytestmark = pytest.mark.slow  # two jobs (2 and 4 ranks): ~45 s on a 2-core CPU

CASES = {  # name: (world, preset, seq_len, degrees)
    "dp_shard 2": (2, "debug", 256, dict(shard=2)),
    "head 2": (2, "debug", 256, dict(head=2)),
    "ctx 2": (2, "debug", 256, dict(ctx=2)),
    "dp_shard 4": (4, "debug", 256, dict(shard=4)),
    "HSDP 2 x 2": (4, "debug", 256, dict(rep=2, shard=2)),
    "head 2 x ctx 2": (4, "debug", 256, dict(head=2, ctx=2)),
    "hpz over 2-rank nodes": (4, "debug", 256, dict(shard=4, zero_pp="hpz", node=2)),
    "ctx 4 Double-Ring (window 2)": (4, "debug", 512, dict(ctx=4, window=2)),
    "head 2 x ctx 2 full recompute": (4, "debug", 256, dict(head=2, ctx=2, recompute="full")),
    "debug-moe dp_shard 4 x expert 2": (4, "debug-moe", 256, dict(shard=4, expert=2)),
}

# ZeRO++'s int8 parts: the per-rank forms count int8 blocks unpadded (1 + 4 / block bytes per element), the ranks
# send whole blocks per unit (bench comm's per-link forms count them: test_link_bytes_audit_links.py)
QUANTISED = {
    "qwz over 2-rank nodes": (4, "debug", 256, dict(shard=4, zero_pp="qwz", node=2)),
    "qgz over 2-rank nodes": (4, "debug", 256, dict(shard=4, zero_pp="qgz", node=2)),
}


@pytest.fixture(scope="module")
def sent():
    """{case: [per rank {"raw", "comm", "library"}]}, one job per world size."""
    out = {}
    every = {**CASES, **QUANTISED}
    for world in (2, 4):
        names = [n for n, c in every.items() if c[0] == world]
        raws = [layout_config(every[n][1], every[n][2], **every[n][3]) for n in names]
        for name, ranks in zip(names, zip(*run_spawned(world, layout_traffic, raws))):
            out[name] = list(ranks)
    return out


def predicted(name: str) -> dict:
    world, preset, seq_len, degrees = {**CASES, **QUANTISED}[name]
    return planner_bytes(layout_config(preset, seq_len, **degrees))


@pytest.mark.parametrize("name", list(CASES))
def test_the_planners_bytes_are_what_the_ranks_send(name, sent):
    """FSDP's collectives (all-gathers, reduce-scatters, HSDP's all-reduce) and a MoE model's router statistics'
    all-reduce carry the planner's fsdp and router bytes; the
    ring's sends its ctx bytes, the head all-to-alls its head bytes, to the byte. The expert all-to-alls follow
    the routed counts (the planner assumes even routing: see test_expert_bytes_follow_the_routed_rows)."""
    comm = predicted(name)
    for rank, got in enumerate(sent[name]):
        ops = by_op(got["raw"])
        assert got["raw"]["unknown"] == [], got["raw"]
        rings = ops.get("all_gather", 0) + ops.get("reduce_scatter", 0) + ops.get("all_reduce", 0)
        assert rings == collective_bytes(comm), (rank, got["raw"], comm)
        assert ops.get("send", 0) == sum(comm.get("ctx", {}).values()), (rank, got["raw"], comm)
        if "expert" not in comm:
            assert ops.get("all_to_all", 0) == sum(comm.get("head", {}).values()), (rank, got["raw"], comm)


@pytest.mark.parametrize("name", list(CASES))
def test_job_comm_and_library_traffic_count_what_the_operators_carry(name, sent):
    """job/comm.py's counters and library_traffic (what the training loop and `longctx plan --validate`
    read) add up to the operators' bytes on every rank (comm floors each all-reduce's share to whole bytes)."""
    for rank, got in enumerate(sent[name]):
        counted = sum(sum(labels.values()) for labels in got["comm"].values()) + sum(got["library"].values())
        raw = sum(got["raw"]["ops"].values())
        assert counted == pytest.approx(raw, abs=8), (rank, got)


def test_expert_bytes_follow_the_routed_rows(sent):
    """Under expert parallelism a rank's expert all-to-alls send its routed rows out (dispatch) and the rows it
    received back (combine), forward and backward: over an expert group of 2 the pair's figures are equal, and
    the job's mean is the even-routing figure scaled by how many rows left their rank (here uneven, so only
    bounded: never more than every row of every token's top_k)."""
    name = "debug-moe dp_shard 4 x expert 2"
    comm = predicted(name)
    a2a = [by_op(got["raw"])["all_to_all"] - comm["expert"]["expert_counts"] for got in sent[name]]
    assert a2a[0] == a2a[1] and a2a[2] == a2a[3]  # groups (0, 1) and (2, 3)
    for got in a2a:
        assert 0 < got <= 2 * comm["expert"]["expert"]  # even routing sends half of every row to the peer
    assert [got["comm"]["expert"]["expert"] for got in sent[name]] == a2a


@pytest.mark.parametrize("name", list(QUANTISED))
def test_zero_pps_int8_bytes_are_the_planners_but_for_whole_blocks(name, sent):
    """Each unit's int8 rows are cut into whole blocks of 512 with a 4-byte scale: the ranks send at most a
    block and a scale per unit and collective more than the planner's unpadded count (0.3% here), never less."""
    comm = predicted(name)
    units, passes = 5, 3  # 4 blocks and the root; two gathers and a reduce per unit at most
    for rank, got in enumerate(sent[name]):
        ops = by_op(got["raw"])
        fsdp = ops.get("all_gather", 0) + ops.get("reduce_scatter", 0) + ops.get("all_to_all", 0)
        assert 0 <= fsdp - comm["fsdp"]["fsdp"] <= units * passes * 3 * (512 + 4), (rank, got["raw"], comm)
