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
