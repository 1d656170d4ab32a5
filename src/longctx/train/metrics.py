"""Training metrics: model FLOPs, MFU, memory, one printed line and one JSONL record per log step.

FLOPs are *model* FLOPs (what the math needs, not what recomputation adds), including the
attention score term: per layer and token, forward, 2 x (matmul parameters) + 4 x seq x d_attn,
the attention term halved under a causal mask (counted so also with document masks, which skip
more: MFU is then an upper bound, as in most reports); the LM head adds 2 x dim x vocab; training
is 3x forward. MFU divides achieved model FLOP/s by the device's peak: the dense bf16 peak for known
GPUs, or on CPU the machine's fp32 GEMM peak with all its cores, calibrated once and cached (so MFU
compares across runs), shared by the ranks on the machine (the line says which).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from .config import ModelConfig

# Dense (no sparsity) bf16 peaks in FLOP/s, from vendor data sheets, matched on the device name.
GPU_PEAK_BF16 = {  # most specific names first
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def matmul_params_per_layer(cfg: ModelConfig) -> int:
    hd = cfg.resolved_head_dim
    attn = cfg.dim * (cfg.heads + 2 * cfg.kv_heads) * hd + cfg.heads * hd * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return attn + mlp


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one forward pass, per token of a sequence of length seq_len."""
    d_attn = cfg.heads * cfg.resolved_head_dim
    attn_scores = 4 * seq_len * d_attn * (0.5 if causal else 1.0)
    per_layer = 2 * matmul_params_per_layer(cfg) + attn_scores
    return cfg.layers * per_layer + 2 * cfg.dim * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def measure_cpu_gemm_peak(size: int = 1024, seconds: float = 0.3) -> float:
    """Best fp32 GEMM FLOP/s this process reaches with its current thread count."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * size**3 / dt)
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


def machine_cpu_peak() -> tuple[float, Path, bool]:
    """This machine's fp32 GEMM FLOP/s with all its usable cores: (FLOP/s, cache file, measured now).

    Measured once (about 2 s, with every core, best of several GEMMs) and cached under a key of the
    CPU model, core count and torch version; measured at each start instead, the figure varied 10x
    with whatever else ran (other ranks starting up included), and MFU could not be compared across
    runs. Delete the file to re-calibrate.
    """
    path, key, cached = _cached_peaks()
    if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key]), path, False
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        peak = measure_cpu_gemm_peak(size=2048, seconds=2.0)
    finally:
        torch.set_num_threads(threads)
    cached[key] = peak
    _write_peaks(path, cached)
    return peak, path, True


def _cached_peaks() -> tuple[Path, str, dict]:
    """(the cache file, this machine's key in it, every machine's cached peak; {} if none or unreadable)."""
    from .cache_dir import cache_root

    path = cache_root() / CPU_PEAK_FILE
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    key = f"{_cpu_name()} | {usable_cores()} cores | torch {torch.__version__.split('+')[0]}"
    return path, key, cached if isinstance(cached, dict) else {}


def _write_peaks(path: Path, peaks: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(peaks, indent=1))
        tmp.replace(path)  # whole or not at all, also when two jobs calibrate at once
    except OSError:  # a read-only cache: the figure still holds for this run
        pass


def raise_cpu_peak(flops: float) -> Path:
    """A run did `flops` FLOP/s on this machine, more than the cached peak: that calibration ran
    while the machine was busy. The cache keeps the higher figure, so MFU stays <= 1 from now on."""
    path, key, cached = _cached_peaks()
    cached[key] = max(float(cached.get(key, 0.0)), flops)
    _write_peaks(path, cached)
    return path


def device_peak(device: torch.device, override_tflops: float = 0.0,
                local_ranks: int = 1) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank or None, where the figure comes from). On CPU the machine's peak is
    shared by the `local_ranks` ranks that run on it."""
    if override_tflops:
        return override_tflops * 1e12, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak, f"{key} bf16 dense peak"
        return None, f"unknown GPU '{name}' (set metrics.peak_tflops)"
    peak, path, _ = machine_cpu_peak()
    shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    return peak / local_ranks, f"this machine's CPU fp32 GEMM peak {peak / 1e12:.3f} TFLOP/s{shared} (cached in {path})"


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max allocated"
    # ru_maxrss is in KiB on Linux and bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "peak RSS"


class MetricsWriter:
    """Appends one JSON object per record to a JSONL file; optionally mirrors to TensorBoard."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def format_line(r: dict) -> str:
    parts = [f"step {r['step']:>5}", f"loss {r['loss']:.4f}"]
    if "grad_norm" in r:
        parts.append(f"gnorm {r['grad_norm']:.3f}")
    if "lr" in r:
        parts.append(f"lr {r['lr']:.2e}")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{r['tflops']:.3f} TFLOP/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['memory_gib']:.2f} GiB ({r['memory_kind']})")
    if r.get("comm_bytes_per_step"):
        parts.append("comm/step " + " ".join(f"{d} {v / 2**20:.1f}MiB" for d, v in r["comm_bytes_per_step"].items()))
    return " | ".join(parts)


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
