"""The peak FLOP/s MFU divides by: the dense peak of known GPUs for the precision the run computes in
(vendor data sheets: bf16 tensor cores; fp32 on the CUDA cores, or TF32 tensor cores where torch allows
them), or on CPU this machine's GEMM peak in that precision (fp32, or bf16 for a train.dtype = bf16 run:
AMX / AVX512-BF16 cores run bf16 GEMMs several times faster) with all its cores, calibrated once per
precision and cached (so MFU compares across runs), shared by the ranks on the machine. Hardware facts,
next to the planner's specs.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from ..cache_dir import cache_root

# Dense (no sparsity) bf16 peaks in FLOP/s, from vendor data sheets, matched on the device name.
GPU_PEAK_BF16 = {  # most specific names first
    "H200 NVL": 835e12,  # (the PCIe card: "NVIDIA H200 NVL"; matched as an H200 SXM, its MFU read 16% low)
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800 PCIe": 756e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}
# Plain fp32 (CUDA cores, no tensor cores) in FLOP/s, same sources: what a train.dtype = fp32 run's
# matmuls reach while torch keeps TF32 off (its default). Dividing such a run by the bf16 peak read
# its MFU 15x low (H100: 67 vs 989). A GPU missing here has no fp32 figure: set metrics.peak_tflops.
GPU_PEAK_FP32 = {
    "H200 NVL": 60e12,
    "H200": 67e12,
    "H100 PCIe": 51e12,
    "H100 NVL": 60e12,
    "H100": 67e12,
    "H800 PCIe": 51e12,
    "H800": 67e12,
    "H20": 44e12,
    "A100": 19.5e12,
    "A800": 19.5e12,
    "L40S": 91.6e12,
    "RTX 4090": 82.6e12,
}


def measure_cpu_gemm_peak(size: int = 1024, seconds: float = 0.3, dtype: torch.dtype = torch.float32) -> float:
    """Best GEMM FLOP/s in `dtype` this process reaches with its current thread count, on square matrices
    of at most `size`. The size grows from 256 by doubling while one product takes under an eighth of
    `seconds`: a CPU without native bf16 multiplies 2048 x 2048 bf16 matrices in ~30 s, and a fixed size
    made the "2 s" measurement take 4-5 minutes (a warm-up and a timed product at least) while the other
    ranks waited on it; a fast unit reaches `size` in a few ms."""
    n = min(256, size)
    while True:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        if n >= size or dt * 8 >= seconds:
            break
        n = min(2 * n, size)
    best = 2 * n**3 / max(dt, 1e-9)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
    return best


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (macOS)
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


CPU_PEAK_FILE = "cpu_peak.json"


def machine_cpu_peak(dtype: torch.dtype = torch.float32) -> tuple[float, Path, bool]:
    """This machine's GEMM FLOP/s in `dtype` (fp32 or bf16) with all its usable cores: (FLOP/s, cache
    file, measured now). Each precision has its own entry: a bf16 run divided by the fp32 peak read
    MFU 100% on an AMX machine, and raised the fp32 entry to its bf16 rate (later fp32 runs read low).

    Measured once (about 2-4 s, with every core, best of several GEMMs of a size one product takes
    < 0.25 s at) and cached under a key of the CPU model, core count and torch version, with when it was
    measured, the threads and the load average then (cpu_peak_source says them beside every MFU);
    measured at each start instead, the figure varied 10x with whatever else ran (other ranks starting
    up included), and MFU could not be compared across runs. Delete the file to re-calibrate.
    """
    path, key, cached = _cached_peaks(dtype)
    flops = _flops(cached.get(key))
    if flops:
        return flops, path, False
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        peak = measure_cpu_gemm_peak(size=2048, seconds=2.0, dtype=dtype)
    finally:
        torch.set_num_threads(threads)
    cached[key] = {"flops": peak, "how": "measured", "when": _now(), "threads": usable_cores(), "load": _load()}
    _write_peaks(path, cached)
    return peak, path, True


def _flops(entry) -> float:
    """An entry's FLOP/s (0 when absent or unusable); older caches hold the bare number."""
    value = entry.get("flops") if isinstance(entry, dict) else entry
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:  # pragma: no cover
        return None


def cpu_peak_source(dtype: torch.dtype = torch.float32) -> str:
    """Where this machine's cached CPU peak comes from: 'measured 2026-11-28 03:12 UTC with 2
    threads at load 0.3', 'raised to what a run reached on ...', or 'cached by an older longctx'."""
    _, key, cached = _cached_peaks(dtype)
    entry = cached.get(key)
    if not isinstance(entry, dict):
        return "cached by an older longctx, when unknown"
    if entry.get("how") == "raised":
        return f"raised to what a run reached, {entry.get('when', 'when unknown')}"
    load = f" at load {entry['load']}" if entry.get("load") is not None else ""
    return f"measured {entry.get('when', 'when unknown')} with {entry.get('threads', '?')} threads{load}"


def precision_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _cached_peaks(dtype: torch.dtype = torch.float32) -> tuple[Path, str, dict]:
    """(the cache file, this machine's key in it for `dtype`, every machine's cached peak; {} if none or
    unreadable). fp32's key is the one older caches hold; bf16's ends in ' | bf16'."""
    path = cache_root() / CPU_PEAK_FILE
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    key = f"{_cpu_name()} | {usable_cores()} cores | torch {torch.__version__.split('+')[0]}"
    key += "" if precision_name(dtype) == "fp32" else " | bf16"
    return path, key, cached if isinstance(cached, dict) else {}


def _write_peaks(path: Path, peaks: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(peaks, indent=1))
        tmp.replace(path)  # whole or not at all, also when two jobs calibrate at once
    except OSError:  # a read-only cache: the figure still holds for this run
        pass


def raise_cpu_peak(flops: float, dtype: torch.dtype = torch.float32) -> Path:
    """A run in `dtype` did `flops` FLOP/s on this machine, more than the cached peak of that precision:
    that calibration ran while the machine was busy. The cache keeps the higher figure, so MFU stays <= 1
    from now on (the other precision's entry is left as it is)."""
    path, key, cached = _cached_peaks(dtype)
    if flops > _flops(cached.get(key)):
        cached[key] = {"flops": flops, "how": "raised", "when": _now()}
        _write_peaks(path, cached)
    return path


def device_peak(device: torch.device, override_tflops: float = 0.0, local_ranks: int = 1,
                dtype: torch.dtype | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank or None, where the figure comes from). On a GPU the peak of `dtype`, the
    precision the run computes in (train.dtype; None: bf16); on CPU the machine's peak in that precision
    (None: fp32), shared by the `local_ranks` ranks that run on it."""
    if override_tflops:
        return override_tflops * 1e12, "metrics.peak_tflops"
    if device.type == "cuda":
        return _gpu_peak(torch.cuda.get_device_name(device), dtype or torch.bfloat16)
    dtype = dtype or torch.float32
    peak, path, _ = machine_cpu_peak(dtype)
    shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    return peak / local_ranks, (f"this machine's CPU {precision_name(dtype)} GEMM peak {peak / 1e12:.3f} TFLOP/s"
                                f"{shared}, {cpu_peak_source(dtype)} (cached in {path}; delete it to measure again)")


def _gpu_peak(name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """A GPU's dense peak for `dtype`: bf16 (and fp16: the same tensor-core rate on these cards); fp32
    on the CUDA cores, or, where torch lets fp32 matmuls use TF32 (set_float32_matmul_precision 'high'
    or 'medium'), TF32 tensor cores: half the bf16 rate on every card of the table (A100 156 of 312)."""
    fp32 = dtype == torch.float32
    tf32 = fp32 and torch.get_float32_matmul_precision() != "highest"
    table = GPU_PEAK_FP32 if fp32 and not tf32 else GPU_PEAK_BF16
    kind = "TF32 dense peak" if tf32 else "fp32 peak" if fp32 else "bf16 dense peak"
    for key, peak in table.items():
        if key in name:
            return (peak / 2 if tf32 else peak), f"{key} {kind}"
    return None, f"unknown GPU '{name}' for {kind.split()[0]} (set metrics.peak_tflops)"
