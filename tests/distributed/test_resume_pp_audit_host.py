"""Resume audit of the host tiers across world sizes (memory.model_states = host_optimizer: plain tensors and
gradient hooks at world 1, FSDP shards at world 2; host: FSDP2's CPU offload, a one-rank FSDP job at world 1),
fp32: a checkpoint saved at step 3 under A, resumed under B to step 6, against B's uninterrupted run (losses,
final weights AND every AdamW state tensor as full tensors: tests/resume_pp_audit.py), and the state B's Trainer
holds right after the load against the checkpoint, to the bit; under host_optimizer, the moments its host step
reads are the tensors a save writes (resume_pp_audit.loaded). The previous audit covered host <-> device at
world 2 (test_reshard_audit_state.py); HSDP with the tiers: test_resume_pp_audit_hsdp.py.

Expected: bitwise where B = A; otherwise no further from B's uninterrupted run than A's own run is (world 1 and 2
sum in another order), and losses within docs/memory.md's 1e-5."""

import pytest

from longctx.job.spawn import run_spawned_many
from resume_pp_audit import check_loaded, compare, jobs

HOST_OPTIMIZER, HOST = ["--memory.model_states=host_optimizer"], ["--memory.model_states=host"]
LAYOUTS = {"one-host_optimizer": HOST_OPTIMIZER, "one-host": HOST, "two-device": [],
           "two-host_optimizer": HOST_OPTIMIZER}
ONE = ["one-host_optimizer", "one-host"]
# (A, B) by the world B runs on
TO_TWO = [("one-host_optimizer", "two-device"), ("one-host", "two-host_optimizer"),
          ("two-host_optimizer", "two-host_optimizer")]
TO_ONE = [("two-device", "one-host_optimizer"), ("two-host_optimizer", "one-host"),
          ("one-host_optimizer", "one-host_optimizer")]
LOADS_TWO, LOADS_ONE = [("one-host_optimizer", "two-host_optimizer")], [("two-host_optimizer", "one-host_optimizer")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("host")
    out = run_spawned_many(1, jobs(root, LAYOUTS, ONE, [], []))
    out.update(run_spawned_many(2, jobs(root, LAYOUTS, ["two-device", "two-host_optimizer"], TO_TWO, LOADS_TWO)))
    out.update(run_spawned_many(1, jobs(root, LAYOUTS, [], TO_ONE, LOADS_ONE)))
    return root, out


@pytest.mark.parametrize("a, b", TO_TWO + TO_ONE)
def test_a_resume_across_host_tiers_and_worlds_keeps_the_optimizer_state(runs, a, b, tmp_path):
    loss, state, _, own = compare(*runs, a, b, tmp_path)
    if a == b:
        assert loss == 0.0 and state == 0.0
    else:
        assert loss <= 1e-5 and state <= 2 * own + 1e-6


@pytest.mark.parametrize("a, b", LOADS_TWO + LOADS_ONE)
def test_the_loaded_state_is_the_checkpoint_to_the_bit(runs, a, b, tmp_path):
    check_loaded(*runs, a, b, tmp_path)
