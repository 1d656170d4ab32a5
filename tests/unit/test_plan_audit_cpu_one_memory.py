"""A plan for this CPU (`--hardware cpu-measured` or a file calibrated by --calibrate-out) must fit the figure
`longctx train`'s preflight checks on a CPU: the device is host memory, so the run's peak is its device and host
bytes in one memory, and under memory.model_states = device the foreach AdamW's step holds 20 bytes per parameter
(costs/host_bytes.py one_memory_bytes). The planner checked only the GPU-style total (16 B/param + activations):
llama3-1b at 1K tokens on a 24 GiB machine was written as fitting (20.3 of 21.2 GiB usable) and the run was then
refused by the preflight (23.0 GiB needed)."""

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.host_bytes import one_memory_bytes, predicted_rank_bytes
from longctx.costs.model_states import param_counts
from longctx.costs.rank_process import PROCESS_BYTES
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import footprint, gib_text
from longctx.planner.request import Request
from longctx.planner.search import plan

SEQ = 64


def _cpu(usable_bytes: float):
    return PRESETS["h100"].replace(name="cpu-measured", memory_gib=usable_bytes / 0.9 / 2**30, host_memory_gib=0.0,
                                   usable_memory_fraction=0.9, usable_host_fraction=0.0, dtype_bytes=4,
                                   comm_overlap=0.0)


def _between():
    """(model, usable bytes between the GPU-style total and the CPU run's peak, that peak) for debug, device
    tier, full recomputation."""
    m = load_config(None, ["--model.preset=debug"]).model
    policy = MemoryPolicy("full")
    device, host = predicted_rank_bytes(m, MeshShape(), policy, "device", seq_len=SEQ, micro_batch=1, grad_accum=1,
                                        dtype_bytes=4, device_type="cpu")  # what the preflight counts
    peak = one_memory_bytes(m, MeshShape(), "device", device, host)
    assert peak >= 20 * param_counts(m)["total"] > device["total"]
    peak += PROCESS_BYTES  # and the rank's interpreter, in the same memory (a rank the preflight starts: plan114)
    return m, policy, (device["total"] + peak) / 2, peak


def test_cpu_footprint_counts_the_one_memory_peak():
    m, policy, usable, peak = _between()
    fp = footprint(m, _cpu(usable), MeshShape(), policy, seq_len=SEQ, global_batch=1, model_states="device")
    assert fp.memory["total"] < usable  # the GPU-style figure fits ...
    assert not fp.feasible  # ... but the run the preflight counts does not
    assert f"needs {gib_text(peak)} GiB of this CPU's memory per process" in fp.problems[0]


def test_cpu_plan_never_writes_a_device_plan_the_preflight_refuses():
    m, _, usable, _ = _between()
    res = plan(Request(m, _cpu(usable), 1, SEQ, recomputes=("full",), model_states=("device",),
                       offload_fractions=()), explain=False)
    assert res.best is None


def test_gpu_hardware_unchanged():
    m, policy, usable, _ = _between()
    gpu = PRESETS["h100"].replace(memory_gib=usable / 0.92 / 2**30, dtype_bytes=4)
    assert footprint(m, gpu, MeshShape(), policy, seq_len=SEQ, global_batch=1, model_states="device").feasible
