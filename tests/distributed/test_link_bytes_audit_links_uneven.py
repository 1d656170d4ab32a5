"""The link-level closed forms and the planner's figures (planner/slow_links.py link_level_bytes) on 2 nodes x 3
ranks, where a group of 3 or 6 ranks divides none of the debug model's 128-wide tensors nor its 320-row
embeddings: FSDP2 pads dim 0, and its collectives carry the padding. The planner's units were ceil(params /
group) per block (1.5% low at 6 ranks) and co2's outer all-reduce the padded shards (each rank sends its
unpadded one); the metrics line's FSDP bytes were from the unpadded counts. Counted by tests/link_audit.py
RawLinks from the c10d operators (see test_link_bytes_audit_links.py)."""

import pytest

from link_audit import trainer_links
from longctx.bench.comm_bytes import step_bytes
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.link_bytes import layout_bytes
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.planner.slow_links import link_level_bytes

pytestmark = pytest.mark.slow  # one 6-rank job of 3 short runs: ~40 s on a 2-core CPU

NODES, RANKS = 2, 3
RUNS = [("fsdp", 1), ("co2", 1), ("fsdp", 2)]
LEVELS = ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes")
# the closed forms floor each all-reduce's 2 (n - 1) / n share to whole bytes; a rank's loss share is 13.33 B
ROUNDING = NODES * RANKS


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return run_spawned(NODES * RANKS, trainer_links, NODES, RANKS, RUNS, str(tmp_path_factory.mktemp("links")))


def shape_of(mode: str, replicas: int) -> MeshShape:
    if mode == "co2":
        return MeshShape(NODES, RANKS, data_parallel="co2", local_steps=2)
    return MeshShape(replicas, NODES * RANKS // replicas)


@pytest.mark.parametrize("mode,replicas", RUNS, ids=[f"{m}-{r}" for m, r in RUNS])
def test_the_closed_forms_and_the_planner_count_the_padded_shards(counted, mode, replicas):
    got = counted[0][f"{mode}-{replicas}"]
    closed = (layout_bytes("fsdp", got["units"], NODES, RANKS, replicas) if replicas > 1
              else step_bytes(mode, got["units"], NODES, RANKS, got["block"], local_steps=2))
    model = load_config(None, ["--model.preset=debug"]).model
    hw = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")  # fp32 gathers, as on the CPU
    planner = link_level_bytes(model, shape_of(mode, replicas), hw, RANKS)
    for level in LEVELS:
        assert closed[level] == pytest.approx(got[level], abs=ROUNDING), (level, got, closed)
        assert planner[level] == pytest.approx(got[level], abs=ROUNDING), (level, got, planner)


def test_the_metrics_lines_fsdp_bytes_count_the_padding(counted):
    for name in ("fsdp-1", "fsdp-2"):
        for rank, r in enumerate(counted):
            assert r[name]["metrics_fsdp"] == pytest.approx(r[name]["rank_fsdp"], abs=1), (name, rank, r[name])
