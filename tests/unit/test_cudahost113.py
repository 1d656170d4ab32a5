"""A CUDA rank holds its CUDA context and the libraries it loads (the CUDA runtime, cuBLAS, cuDNN, NCCL) in host
memory: ~1 GiB each (docs/results/gpu_frontier_nvidia-h200_2026-12-04.json: a debug run peaked at 1.39 GiB of host
memory, the same run on a CPU at 0.54), ~8 GiB at 8 ranks per node that the host preflight and the planner's
host/node did not count. Both now add one figure, costs/cuda_runtime.py CUDA_RUNTIME_BYTES, part "cuda_runtime",
on a CUDA run where the free memory does not hold it yet; a CPU run is counted as before."""

import json
from pathlib import Path

import pytest
import torch

from longctx.config import load_config
from longctx.costs.cuda_runtime import CUDA_RUNTIME_BYTES
from longctx.costs.hardware import get_hardware
from longctx.costs.host_bytes import one_memory_bytes, predicted_rank_bytes
from longctx.costs.rank_process import PROCESS_BYTES
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.memory.policy import MemoryPolicy
from longctx.memory.rss import current_rss_bytes
from longctx.planner.cost import estimate
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, rank_host_bytes, run_shape

GIB = 2**30
MEASURED = Path(__file__).parents[2] / "docs/results/gpu_frontier_nvidia-h200_2026-12-04.json"


def config(device: str, *more: str):
    return load_config("configs/debug.toml", [f"--train.device={device}", "--train.global_batch=8", *more])


def run_bytes(cfg, dims, device_type: str) -> tuple[dict, dict]:
    """(device, host) bytes of one rank of `cfg` from costs/host_bytes.py, as the preflight asks them (fp32 where
    the debug config's dtype auto is, on a CPU and on a card the launcher does not start CUDA to ask)."""
    bf16 = device_type == "cuda"  # (auto: bf16 on a card, assumed native before CUDA starts)
    shape = run_shape(cfg, dims)
    return predicted_rank_bytes(cfg.model, shape, MemoryPolicy.from_config(cfg.memory), cfg.memory.model_states,
                                seq_len=cfg.train.seq_len, micro_batch=cfg.train.global_batch // shape.dp,
                                grad_accum=1, dtype_bytes=2 if bf16 else 4, doc_mask=cfg.data.doc_mask,
                                device_type=device_type)


def started(monkeypatch) -> None:
    """CUDA started in this process, on a card with native bf16 (what job/devices.py native_bf16 then asks)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def test_the_constant_is_the_measured_gpu_run_less_its_interpreter():
    peak = json.loads(MEASURED.read_text())["smoke"]["device"]["host_peak_gib"] * GIB
    # the GPU run's peak holds the runtime beside an interpreter with torch (>= 0.25 GiB: tests/unit/
    # test_host_budget_rank_processes.py's ~0.3) and the debug run's own bytes
    assert 0.5 * GIB < CUDA_RUNTIME_BYTES <= peak - 0.25 * GIB


def test_a_cuda_rank_counts_its_runtime_and_a_cpu_rank_as_before():
    cfg = config("cuda")
    dims = check_layout(cfg, 4)
    _, host = run_bytes(cfg, dims, "cuda")
    got = rank_host_bytes(cfg, dims, "cuda", 4, 1e12)
    assert got["cuda_runtime"] == CUDA_RUNTIME_BYTES
    assert got["total"] == pytest.approx(host["total"] + CUDA_RUNTIME_BYTES)
    # a rank that made its context already (this process, CUDA started): the free memory holds it
    assert rank_host_bytes(cfg, dims, "cuda", 4, 1e12, cuda_context_held=True)["total"] == pytest.approx(host["total"])
    # a CPU run: its host bytes and its device's, as one memory holds them (the figure before), no runtime
    cpu = config("cpu")
    device, host = run_bytes(cpu, dims, "cpu")
    on_cpu = rank_host_bytes(cpu, dims, "cpu", 4, 1e12)
    assert "cuda_runtime" not in on_cpu
    assert on_cpu["total"] == pytest.approx(one_memory_bytes(cpu.model, run_shape(cpu, dims), "device", device,
                                                            host, 1))


def test_the_preflight_refuses_a_node_that_holds_the_run_but_not_its_cuda_runtime(monkeypatch):
    cfg = config("cuda")
    dims = check_layout(cfg, 1)
    _, host = run_bytes(cfg, dims, "cuda")
    assert not torch.cuda.is_initialized()  # (the launcher's --nproc 1: this process becomes the rank)
    monkeypatch.setenv(BUDGET_ENV, str(int(host["total"] + CUDA_RUNTIME_BYTES / 2)))
    with pytest.raises(ConfigError, match=r"1 rank; .*cuda runtime 0\.9\d GiB.*To fit, try: fewer ranks per node"):
        check_host_memory(cfg, dims, 1, "cuda")
    monkeypatch.setenv(BUDGET_ENV, str(int(host["total"] + CUDA_RUNTIME_BYTES + 1)))
    check_host_memory(cfg, dims, 1, "cuda")  # fits
    # where CUDA started in this process before the check, its context is in the free memory already
    started(monkeypatch)
    monkeypatch.setenv(BUDGET_ENV, str(int(host["total"] + CUDA_RUNTIME_BYTES / 2)))
    check_host_memory(cfg, dims, 1, "cuda")


def test_cuda_initialised_without_a_context_is_not_held(monkeypatch):
    # (train.compile's Triton check in the launcher asks the card's properties: torch.cuda initialised, no context)
    cfg = config("cuda")
    dims = check_layout(cfg, 1)
    _, host = run_bytes(cfg, dims, "cuda")
    started(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: False, raising=False)
    monkeypatch.setenv(BUDGET_ENV, str(int(host["total"] + CUDA_RUNTIME_BYTES / 2)))
    with pytest.raises(ConfigError, match="cuda runtime"):
        check_host_memory(cfg, dims, 1, "cuda")
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: True, raising=False)
    check_host_memory(cfg, dims, 1, "cuda")  # its context made: held


def test_ranks_to_start_count_theirs_whatever_this_process_holds(monkeypatch):
    cfg = config("cuda")
    dims = check_layout(cfg, 4)
    _, host = run_bytes(cfg, dims, "cuda")
    process = min(current_rss_bytes(), PROCESS_BYTES)
    started(monkeypatch)  # (the launcher's own context: not theirs)
    monkeypatch.setenv(BUDGET_ENV, str(int(4 * (host["total"] + process + CUDA_RUNTIME_BYTES / 2))))
    with pytest.raises(ConfigError, match=r"4 ranks x .*cuda runtime 3\.\d\d GiB") as err:
        check_host_memory(cfg, dims, 4, "cuda", new_processes=True)
    assert "fewer ranks on this node" not in str(err.value)  # (the runtime's advice says it once)
    monkeypatch.setenv(BUDGET_ENV, str(int(4 * (host["total"] + process + CUDA_RUNTIME_BYTES) * 1.02)))
    check_host_memory(cfg, dims, 4, "cuda", new_processes=True)  # fits


def test_a_cpu_run_is_refused_where_it_was_and_names_no_runtime(monkeypatch):
    cfg = config("cpu")
    dims = check_layout(cfg, 4)
    device, host = run_bytes(cfg, dims, "cpu")
    need = 4 * one_memory_bytes(cfg.model, run_shape(cfg, dims), "device", device, host, 1)
    monkeypatch.setenv(BUDGET_ENV, str(int(need) + 1))
    check_host_memory(cfg, dims, 4, "cpu")
    monkeypatch.setenv(BUDGET_ENV, str(int(need) - 1))
    with pytest.raises(ConfigError) as err:
        check_host_memory(cfg, dims, 4, "cpu")
    assert "cuda runtime" not in str(err.value)


def test_a_gpu_plan_counts_the_runtime_per_rank_as_the_preflight_does():
    cfg = config("cuda")
    dims = check_layout(cfg, 8)
    shape = run_shape(cfg, dims)
    policy = MemoryPolicy.from_config(cfg.memory)
    kw = {"seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch, "micro_batch": 1,
          "gpus_per_node": 8, "doc_mask": cfg.data.doc_mask}
    gpu = estimate(cfg.model, get_hardware("h100"), shape, policy, **kw)
    _, host = run_bytes(cfg, dims, "cuda")
    assert gpu.host["cuda_runtime"] == CUDA_RUNTIME_BYTES
    assert gpu.host_per_node == pytest.approx(8 * (host["total"] + CUDA_RUNTIME_BYTES + PROCESS_BYTES))
    # the plan and the preflight agree on a rank's host bytes (a rank to start: its interpreter too, plan114)
    assert gpu.host["total"] == pytest.approx(rank_host_bytes(cfg, dims, "cuda", 8, 1e12)["total"] + PROCESS_BYTES)
    # a CPU calibration's plan has none
    cpu = estimate(cfg.model, get_hardware("h100").replace(name="cpu-test"), shape, policy, **kw)
    assert "cuda_runtime" not in cpu.host
