"""The metrics line's FSDP bytes per rank under parallel.zero_pp (parallel/context/volumes.py fsdp_bytes
with a ZeroPP): for every mode, a rank's bytes times the world equal the job totals of bench comm's
closed forms (costs/link_bytes.py step_bytes, which tests/distributed/test_bench_comm.py holds to the
emulated cluster's count), less the step's loss all-reduce, on shards that split into whole blocks.
Before this, the line said plain FSDP's fp32 figure under qwz and qgz too."""

import pytest

from longctx.costs.link_bytes import PARTS, Unit, _loss_bytes, step_bytes
from longctx.parallel.context.volumes import ZeroPP, fsdp_bytes

NODES, RANKS, BLOCK = 2, 4, 512
WORLD = NODES * RANKS
BLOCKS, ROOT = WORLD * BLOCK * 3, WORLD * BLOCK  # elements: every shard whole int8 blocks


@pytest.mark.parametrize("mode", ["fsdp", "hpz", "qwz", "qgz", "zeropp"])
@pytest.mark.parametrize("hpz", [0, 2])
def test_a_ranks_bytes_are_the_closed_forms_share(mode, hpz):
    units = [Unit(BLOCKS // WORLD, BLOCKS // RANKS, hpz_elements=BLOCKS // hpz if hpz else 0),
             Unit(ROOT // WORLD, ROOT // RANKS, root=True)]
    job = step_bytes(mode, units, NODES, RANKS, block=BLOCK, hpz_ranks=hpz)
    loss = sum(_loss_bytes(WORLD, NODES, 0))
    zero_pp = ZeroPP(frozenset(PARTS[mode]), BLOCK, node=RANKS, hpz=hpz)
    rank = fsdp_bytes(BLOCKS + ROOT, WORLD, 1, 4, ROOT, zero_pp=zero_pp)
    assert WORLD * rank == pytest.approx(job["inter_node_bytes"] + job["intra_node_bytes"] - loss, rel=1e-12)
    if mode != "fsdp":  # each part sends less than plain FSDP's fp32 figure (hpz: backward's gather is smaller)
        assert rank < fsdp_bytes(BLOCKS + ROOT, WORLD, 1, 4, ROOT)


def test_a_hpz_partition_as_large_as_the_group_is_none_and_expert_units_gather_int8():
    """(parallel/fsdp/shard.py quantize_gathers) hpz over a partition as large as the shard group (one
    node; co2 with a replica per node) partitions nothing: FSDP2 reshards fully and every gather,
    backward's too, goes through qwz's int8 one, so the bytes are qwz's alone; they counted hpz's exact
    backward gather. The experts' units (expert parallelism) gather through qwz's int8 too, with or
    without hpz (they keep plain resharding); they were counted as plain fp32 gathers under qwz."""
    from types import SimpleNamespace

    from longctx.parallel.context.volumes import fsdp_bytes_per_step

    total = BLOCKS + ROOT
    qwz = ZeroPP(frozenset({"qwz"}), BLOCK, node=RANKS)
    whole = ZeroPP(frozenset({"hpz", "qwz"}), BLOCK, node=WORLD)  # the node is the whole group
    assert fsdp_bytes(total, WORLD, 1, 4, ROOT, zero_pp=whole) == fsdp_bytes(total, WORLD, 1, 4, ROOT, zero_pp=qwz)
    hpz_only = ZeroPP(frozenset({"hpz"}), BLOCK, node=WORLD)
    assert fsdp_bytes(total, WORLD, 1, 4, ROOT, zero_pp=hpz_only) == fsdp_bytes(total, WORLD, 1, 4, ROOT)
    dims = SimpleNamespace(dp_shard=WORLD, head=1, ctx=1, dp_replicate=1, expert=2)
    experts, group = BLOCKS // 2, WORLD // 2
    int8_experts = fsdp_bytes(experts // 2, group, 1, 4, zero_pp=ZeroPP(frozenset({"qwz"}), BLOCK))
    assert int8_experts < fsdp_bytes(experts // 2, group, 1, 4)
    for zero_pp in (qwz, ZeroPP(frozenset({"hpz", "qwz"}), BLOCK, node=RANKS)):  # hpz's partition: the group's size
        got = fsdp_bytes_per_step(total, ROOT, dims, 1, 4, expert_params=experts, zero_pp=zero_pp)["fsdp"]
        dense = fsdp_bytes(total - experts, WORLD, 1, 4, ROOT, zero_pp=zero_pp)
        assert got - dense == pytest.approx(int8_experts, rel=1e-12), zero_pp
