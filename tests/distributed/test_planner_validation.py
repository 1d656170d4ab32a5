"""The planner's predictions against measurement on gloo ranks, one real training step per case:
communication bytes equal comm.py's counters on every rank, FSDP2's own traffic equals the
planner's FSDP bytes and each rank's model-state bytes the planner's figure (see
test_fsdp_bytes.py for how they are measured), activation bytes (measured as `longctx bench
memory` does) within 5%."""

import pytest

from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner.validate import Case, run_case

# any hardware works for bytes (only step times depend on it); fp32 like the CPU run
HW = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")

CASES = [
    Case("head2 none", "debug", 512, MeshShape(1, 1, 2, 1)),
    Case("ctx2 full", "debug", 512, MeshShape(1, 1, 1, 2), MemoryPolicy("full")),
    Case("head2xctx2 selective ctx-first", "debug", 512, MeshShape(1, 1, 2, 2, 0, "ctx-first"),
         MemoryPolicy("selective")),
    Case("dp2xctx2 offload 0.5 grad_accum 2", "debug", 512, MeshShape(1, 2, 1, 2), MemoryPolicy("selective", 0.5),
         grad_accum=2),
    Case("ctx4 window 2 offload 1", "debug", 512, MeshShape(1, 1, 1, 4, 2), MemoryPolicy("selective", 1.0)),
    Case("rep2xhead2 no doc mask", "debug", 512, MeshShape(2, 1, 2, 1), docs=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_predicted_bytes_match_measurement(case):
    row = run_case(case, HW, steps=1, warmup=0)
    assert row["grad_accum"] == case.grad_accum and row["global_batch"] == case.global_batch
    assert row["comm_equal_all_ranks"], (row["comm_predicted"], row["comm_measured_rank0"])
    assert row["comm_predicted"], "a parallel layout communicates"
    assert row["fsdp_equal_all_ranks"], (row["fsdp_predicted"], row["fsdp_measured"])
    assert row["model_states_measured"] == [pytest.approx(row["model_states_predicted"], rel=1e-12)] * case.world
    assert len(row["activations_measured"]) == row["world"]
    assert row["activations_max_rel_error"] <= 0.05, (row["activations_predicted"], row["activations_measured"])
    for measured in row["host_measured"]:
        assert measured == pytest.approx(row["host_predicted"], rel=0.05, abs=1)
