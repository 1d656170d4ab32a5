"""FSDP time under expert parallelism (costs/timing.py exposed_fsdp_seconds): a MoE layer's routed experts
are FSDP units of their own over the expert-data group (world / expert ranks, no replicas), which keep
plain resharding under hpz and FSDP's own fp32 reduce-scatter under qgz (parallel/fsdp/shard.py). The
time counted the rank's expert share as part of its block: gathered over the FSDP group, backward's
gather inside the node under hpz, reduced by qgz's int8 all-to-alls and all-reduced over the replicas.

Checked against the bytes: on links of one bandwidth with no compute to hide behind, a step's exposed
FSDP seconds times that bandwidth are the rank's FSDP bytes, parallel/context/volumes.py
fsdp_bytes_per_step (the closed forms the metrics line and bench comm use), of the tensors FSDP2's collectives
carry (costs/model_states.py fsdp_carried_params: padded to its groups)."""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.costs.model_states import fsdp_carried_params
from longctx.costs.shape import MeshShape
from longctx.costs.timing import exposed_fsdp_seconds
from longctx.memory.policy import MemoryPolicy
from longctx.parallel.context.volumes import ZeroPP, fsdp_bytes_per_step

GBPS = 100.0
FLAT = get_hardware("h100").replace(intra_gbps=GBPS, inter_gbps=GBPS)  # every link the same


@pytest.mark.parametrize("shape", [
    MeshShape(dp_shard=16, expert=8, zero_pp="hpz,qwz,qgz", node=8),
    MeshShape(dp_shard=32, expert=4, zero_pp="hpz,qwz,qgz", node=8),
    MeshShape(dp_replicate=2, dp_shard=8, expert=8),
    MeshShape(dp_shard=16, expert=8),
], ids=lambda s: s.describe())
def test_fsdp_seconds_are_the_bytes_over_the_link_under_expert_parallelism(shape):
    m = load_config(None, ["--model.preset=debug-moe"]).model
    pc = fsdp_carried_params(m, shape)  # the tensors as FSDP2 pads them (the router's 8 rows over 16 ranks: 16)
    seconds = exposed_fsdp_seconds(m, shape, MemoryPolicy(), 1, 2, 0.0, 0.0, FLAT, 8)
    zero_pp = ZeroPP(frozenset(p for p in shape.zero_pp.split(",") if p), node=shape.node)
    nbytes = fsdp_bytes_per_step(pc["total"], pc["root"], shape, 1, 2, expert_params=pc["experts"],
                                 zero_pp=zero_pp)["fsdp"]
    assert seconds * GBPS * 1e9 == pytest.approx(nbytes, rel=1e-9)


def test_without_expert_parallelism_the_experts_stay_in_their_block():
    m = load_config(None, ["--model.preset=debug-moe"]).model
    shape = MeshShape(dp_shard=16, zero_pp="hpz,qwz,qgz", node=8)
    pc = fsdp_carried_params(m, shape)  # (the experts' and the router's 8 rows over 16 ranks: 16)
    seconds = exposed_fsdp_seconds(m, shape, MemoryPolicy(), 1, 2, 0.0, 0.0, FLAT, 8)
    nbytes = fsdp_bytes_per_step(pc["total"], pc["root"], shape, 1, 2, expert_params=pc["experts"],
                                 zero_pp=ZeroPP(frozenset({"hpz", "qwz", "qgz"}), node=8))["fsdp"]
    assert seconds * GBPS * 1e9 == pytest.approx(nbytes, rel=1e-9)
