"""Resume audit of HSDP (parallel.dp_replicate = 2 replicas of a 2-rank FSDP group), alone, with ZeRO++'s qgz
inside each replica, and with the model states in host memory (memory.model_states = host_optimizer, host), fp32:
a checkpoint saved at step 3 under A, resumed under B to step 6, against B's uninterrupted run (losses, final
weights AND every AdamW state tensor as full tensors: tests/resume_pp_audit.py), and the state B's Trainer holds
right after the load against the checkpoint, to the bit. The replicas hold the same shards, so the one copy DCP
keeps of each is every replica's.

Expected: bitwise where B = A; across HSDP <-> plain FSDP and the tiers no further from B's uninterrupted run
than A's own run is (their fp32 reduction orders), which docs/memory.md bounds by 1e-5 on the losses."""

import pytest

from longctx.job.spawn import run_spawned_many
from resume_pp_audit import check_loaded, compare, jobs

HSDP = ["--parallel.dp_replicate=2"]
LAYOUTS = {
    "fsdp": [],
    "hsdp": HSDP,
    # qgz's node mesh splits each replica's FSDP group (nodes of 1 rank: its reduce-scatter is the inter-node one)
    "hsdp-qgz": [*HSDP, "--parallel.zero_pp=qgz", "--parallel.zero_pp_block=64", "--parallel.ranks_per_node=1"],
    "hsdp-host_optimizer": [*HSDP, "--memory.model_states=host_optimizer"],
    "hsdp-host": [*HSDP, "--memory.model_states=host"],
}
SAME = ["hsdp-qgz", "hsdp-host_optimizer"]
ACROSS = [("hsdp", "fsdp"), ("fsdp", "hsdp"), ("hsdp-host_optimizer", "hsdp"), ("hsdp", "hsdp-host"),
          ("hsdp-host", "hsdp-host_optimizer")]
LOADS = [("hsdp", "fsdp"), ("hsdp-qgz", "hsdp"), ("hsdp", "hsdp-host_optimizer"), ("hsdp-host", "hsdp-host_optimizer")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    return root, run_spawned_many(4, jobs(root, LAYOUTS, LAYOUTS, [(x, x) for x in SAME] + ACROSS, LOADS))


@pytest.mark.parametrize("layout", SAME)
def test_a_resume_under_the_same_hsdp_layout_is_bitwise(runs, layout, tmp_path):
    loss, state, _, _ = compare(*runs, layout, layout, tmp_path)
    assert loss == 0.0 and state == 0.0


@pytest.mark.parametrize("a, b", ACROSS)
def test_a_resume_across_hsdp_and_tiers_adds_nothing_to_their_own_difference(runs, a, b, tmp_path):
    loss, state, own_loss, own = compare(*runs, a, b, tmp_path)
    assert loss <= 1e-5 and state <= 2 * own + 1e-6


@pytest.mark.parametrize("a, b", LOADS)
def test_the_loaded_state_is_the_checkpoint_to_the_bit(runs, a, b, tmp_path):
    check_loaded(*runs, a, b, tmp_path)
