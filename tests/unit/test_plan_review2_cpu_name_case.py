"""A hardware whose name starts with "cpu" in any case ("CPU-box") is planned as a CPU (Hardware.is_cpu: the
one-memory check of a CPU run) and its written plan must train on the CPU, as a "cpu-box" one does: output.py's
case-sensitive test left train.device = auto, a GPU run in bf16 the plan never costed."""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.planner.output import plan_config
from longctx.planner.request import Request
from longctx.planner.search import plan


@pytest.mark.parametrize("name", ["cpu-box", "CPU-box", "Cpu-measured"])
def test_cpu_named_hardware_writes_a_cpu_plan(name):
    base = load_config(None, ["--model.preset=debug"])
    hw = PRESETS["h100"].replace(name=name, memory_gib=8.0, host_memory_gib=0.0, usable_host_fraction=0.0,
                                 dtype_bytes=4, comm_overlap=0.0)
    assert hw.is_cpu
    req = Request(base.model, hw, 1, 64, recomputes=("full",), model_states=("device",), offload_fractions=())
    cfg = plan_config(plan(req, explain=False).best, req, base)
    assert (cfg.train.device, cfg.train.dtype) == ("cpu", "fp32")


def test_gpu_hardware_plan_leaves_device_auto():
    base = load_config(None, ["--model.preset=debug"])
    req = Request(base.model, PRESETS["h100"], 1, 64, recomputes=("full",), model_states=("device",),
                  offload_fractions=())
    cfg = plan_config(plan(req, explain=False).best, req, base)
    assert cfg.train.device == "auto"


def test_cpu_peak_refusal_is_not_reported_as_missing_host_memory():
    """A CPU plan refused only by the one-memory peak (cost.memory_problems) on hardware with host memory was
    said to "need host memory the hardware does not have: at least 0.0 GiB per node ... against 51.2 usable"."""
    from longctx.costs.host_bytes import one_memory_bytes, predicted_rank_bytes
    from longctx.costs.shape import MeshShape
    from longctx.memory.policy import MemoryPolicy

    m = load_config(None, ["--model.preset=debug"]).model
    device, host = predicted_rank_bytes(m, MeshShape(), MemoryPolicy("full"), "device", seq_len=64, micro_batch=1,
                                        grad_accum=1, dtype_bytes=4, device_type="cpu")
    usable = (device["total"] + one_memory_bytes(m, MeshShape(), "device", device, {"total": 0.0})) / 2
    hw = PRESETS["h100"].replace(name="cpu-measured", memory_gib=usable / 0.9 / 2**30, host_memory_gib=64.0,
                                 usable_memory_fraction=0.9, usable_host_fraction=0.8, dtype_bytes=4, comm_overlap=0.0)
    res = plan(Request(m, hw, 1, 64, recomputes=("full",), model_states=("device",), offload_fractions=()),
               explain=True)
    assert res.best is None
    assert any("of this CPU's memory per process" in s for s in res.suggestions)
    assert not any("need host memory the hardware does not have" in s for s in res.suggestions)
