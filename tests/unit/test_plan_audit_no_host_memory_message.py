"""Hardware without host memory (cpu-measured: host_memory_gib = 0) refuses host-tier states and offload; the
reason read "needs 0.0 GiB of host memory per node (), 0.0 usable of 0" for a small model, naming neither what
the plan would keep there nor how to plan otherwise."""

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.planner.request import Request
from longctx.planner.search import plan


def test_no_host_memory_says_what_and_how():
    m = load_config(None, ["--model.preset=debug"]).model
    hw = PRESETS["h100"].replace(name="cpu-measured", host_memory_gib=0.0, usable_host_fraction=0.0, dtype_bytes=4)
    res = plan(Request(m, hw, 1, 2048, model_states=("host",)), explain=False)
    assert res.best is None
    problem = res.ranked[0].problems[-1]
    assert "has no host memory (host_memory_gib = 0)" in problem, problem
    assert "model states 13.3 MiB" in problem and "--model-states device" in problem
    assert "--hw host_memory_gib" in problem
