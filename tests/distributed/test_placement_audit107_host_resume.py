"""FlexMoE's placer resumed in the middle of a placement window under memory.model_states = host (audit), as a GPU
would run it on CPU (tests/host_origin.py tags host and device memory): the window's counts restored from the
checkpoint meet the next step's router counts (device) in ExpertPlacer.observe.

Before the fix they were restored next to the first MoE layer's w1, a parameter in host memory under the host
tier, so the first step after the resume added host and device tensors: on a GPU, "Expected all tensors to be on
the same device" (this CPU harness records the mix at parallel/expert/placement.py observe). They are now where
the trainer's router counts are restored (the model's buffers: the device)."""

from test_host_tier_origins import _runs

from longctx.job.spawn import run_spawned_many

# a window of 3: the save at step 3 holds steps 1-2's counts, which the resumed run's step 4 adds to
REPLICAS = ["--parallel.expert=2", "--parallel.expert_replicas=1", "--parallel.expert_placement_window=3"]


def test_a_resumed_placement_window_stays_on_the_device(tmp_path):
    first, resumed = run_spawned_many(2, [("copies", _runs, (REPLICAS, str(tmp_path)))])["copies"][0]
    assert len(first["losses"]) == 3 and resumed["rollbacks"] == 1  # (the paths ran: a resume and a rollback)
    mixes = [e for phase in (first, resumed) for e in phase["events"] if e[0] == "mix"]
    assert not mixes, mixes
