"""`longctx plan --validate`'s exit status is its verdict, and its docstring names four checks per case:
communication and FSDP bytes equal, model-state bytes equal, activations within 5%. The exit status read
only the first two: a planner whose activation or model-state figures were 20% off exited 0, its error
left in a float of the JSON. Each case's row now says each check (the model states: the largest rank's,
which the planner counts, FSDP2 padding the uneven shards; a smaller rank holds a few rows less) and the
exit status holds all of them. The ranks are faked from the planner's own prediction, then one figure is
moved."""

import pytest

from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner import validate

HW = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")
CASE = validate.Case("ctx2 offload", "debug", 256, MeshShape(1, 1, 1, 2), MemoryPolicy("selective", 0.5))


def _ranks(monkeypatch, states=1.0, acts=1.0, host=1.0, small_rank=False):
    """run_case's ranks replaced by ranks that measured the prediction, times the given factors."""
    est, predicted = validate._predict(CASE, HW, validate.case_config(CASE))
    fsdp = est.comm_bytes.get("fsdp", {}).get("fsdp", 0.0)
    host_bytes = est.host["activations"] + est.host["attention_offload"]

    def rank(r):
        held = est.memory["model_states"] * states - (64 if small_rank and r == 1 else 0)
        return {"rank": r, "times": [1.0], "counters": predicted, "fsdp": {"all_gather": fsdp},
                "model_states": held,
                "activations": {"device": est.memory["activations"] * acts, "host": host_bytes * host}}

    monkeypatch.setattr(validate, "run_spawned", lambda world, *_a, **_k: [rank(r) for r in range(world)])
    return validate.run_case(CASE, HW)


def test_a_case_that_measures_what_the_planner_predicts_passes_every_check(monkeypatch):
    row = _ranks(monkeypatch)
    assert row["model_states_equal"] and row["activations_within_5pct"] and row["host_within_5pct"]
    assert _ranks(monkeypatch, small_rank=True)["model_states_equal"]  # (a padded shard's rank holds less)


@pytest.mark.parametrize("moved, check", [({"states": 1.2}, "model_states_equal"),
                                          ({"states": 0.8}, "model_states_equal"),
                                          ({"acts": 1.2}, "activations_within_5pct"),
                                          ({"host": 0.5}, "host_within_5pct")])
def test_a_figure_off_by_more_than_its_tolerance_fails_its_check_and_the_exit_status(monkeypatch, moved, check):
    row = _ranks(monkeypatch, **moved)
    assert row.get(check) is False
    monkeypatch.setattr(validate, "calibrate", lambda world: HW)
    monkeypatch.setattr(validate, "run_case", lambda case, hw, **_k: row)
    assert validate.main(cases=[CASE], ranking_cases=[]) == 1


def test_the_exit_status_is_0_when_every_check_holds(monkeypatch, capsys):
    row = _ranks(monkeypatch)
    monkeypatch.setattr(validate, "calibrate", lambda world: HW)
    monkeypatch.setattr(validate, "run_case", lambda case, hw, **_k: row)
    assert validate.main(cases=[CASE], ranking_cases=[]) == 0
