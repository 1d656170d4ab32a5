"""Hardware the planner plans for: named presets, TOML files, overrides, and a calibration of this machine.

A "hardware" is a model of the machine (h100, a800, ... or a TOML file); "device" in longctx means
only where tensors live (cpu / cuda). A `Hardware` is per GPU (or CPU process) except
`host_memory_gib`, which is per node (the host RAM that offloaded activations of all the node's GPUs
share). Bandwidths are what one GPU can push in one direction: `intra_gbps` inside a node (NVLink /
NVSwitch), `inter_gbps` between nodes (the GPU's share of the node's InfiniBand / RoCE NICs),
`host_link_gbps` to host memory (PCIe), all in GB/s (1e9 bytes/s). A node with a third, fastest level
inside it (Frontier's MI250X: two GCDs per package; GPUs paired on one switch) sets `group_ranks` (the
ranks of one such group) and `middle_gbps` (per GPU between a node's groups); `intra_gbps` is then the
link inside a group. 0 (the presets): two levels. `gemm_efficiency` and
`attention_efficiency` are the fractions of the dense bf16 peak that large GEMMs and flash-attention
forward+backward reach; the planner divides FLOPs by peak x efficiency. `comm_overlap` is the
fraction of overlappable communication (ring hops, FSDP gathers, offload copies) that can hide
behind compute: 1 on GPUs (separate copy engines / NCCL streams), 0 on a CPU, where the same cores
do both.

`load_hardware(spec)` takes a preset name (`hardware_names()`) or the path of a TOML file (a
`[hardware]` table with any fields, optionally `base = "h100"`), as `longctx plan --hardware` does;
then `KEY=VALUE` strings from the command line (`--hw memory_gib=64`) override single fields.
`calibrate()` measures this machine: GEMM FLOP/s, attention FLOP/s, and gloo all-to-all and
point-to-point bandwidth between local processes, with short runs (a few seconds).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import time
from dataclasses import dataclass

from ..config import read_toml
from ..errors import ConfigError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float            # memory of one GPU (one CPU process's share when calibrated)
    peak_tflops: float           # dense bf16 (fp32 GEMM when measured on a CPU)
    intra_gbps: float            # per GPU, one direction, inside a node
    inter_gbps: float            # per GPU, one direction, between nodes
    host_link_gbps: float        # GPU <-> host memory (offload)
    host_memory_gib: float       # per node, shared by its GPUs
    gemm_efficiency: float = 0.70
    attention_efficiency: float = 0.60
    comm_overlap: float = 1.0
    all_to_all_efficiency: float = 1.0     # all-to-all bandwidth as a fraction of the link's
    usable_memory_fraction: float = 0.92   # allocator fragmentation, CUDA context, NCCL buffers
    usable_host_fraction: float = 0.80     # the OS, data loaders, pinned buffers
    dtype_bytes: int = 2                   # activations and gathered parameters (2 = bf16, 4 = fp32)
    host_adam_gparams_per_s: float = 5.0   # the node's host AdamW, 1e9 parameters/s (HOST_ADAM below)
    source: str = "data sheet"
    group_ranks: int = 0                   # a third link level: ranks per group inside a node (0: none)
    middle_gbps: float = 0.0               # per GPU, one direction, between a node's groups (group_ranks > 0)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def usable_host_bytes(self) -> float:
        return self.host_memory_gib * GIB * self.usable_host_fraction

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def is_cpu(self) -> bool:
        """A calibration of a CPU (cpu-measured, or a file based on it): its device memory is host memory."""
        return self.name.lower().startswith("cpu")

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)

    def to_toml(self) -> str:
        lines = ["[hardware]"]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            lines.append(f"{f.name} = {v!r}" if not isinstance(v, str) else f'{f.name} = "{v}"')
        return "\n".join(lines) + "\n"


# Hardware presets. Dense bf16 peaks from vendor data sheets (the same figures as metrics.GPU_PEAK_BF16). NVLink:
# H100/H200 SXM 900 GB/s bidirectional = 450 per direction; A100 600 -> 300; A800 400 -> 200.
# Inter-node: one 400 Gb/s NIC per H100/H200 (50 GB/s), one 200 Gb/s NIC per A100/A800 (25 GB/s).
# PCIe gen5 x16 ~ 50 GB/s achieved, gen4 ~ 25 GB/s. Host memory: 2 TB per node (DGX H100/H200
# and DGX A100 80GB); override with --hw host_memory_gib=1024 for 1 TB nodes.
#
# HOST_ADAM: memory.model_states = host_optimizer / host step AdamW on the host's cores (torch's fused
# CPU AdamW). Measured here (docs/results/cpu_adam_2026-11-28.json): 0.65 ns per parameter on 2
# cores, 1.54e9 parameters/s, which moves ~28 bytes per parameter (reads weight, gradient, two
# moments; writes weight, two moments): ~43 GB/s. A step this simple is memory-bound, so the lent
# machines' 16 cores (8x ours: 12e9/s by cores) are capped by the host's memory bandwidth instead;
# 5e9/s is 140 GB/s of traffic, a reasoned estimate for a 16-core slice of a DGX-class host, not
# a measurement. Override with --hw host_adam_gparams_per_s=... once benchmarks/cpu_adam.py has
# run on the host in question (the field's default, 5.0, is this estimate).
PRESETS: dict[str, Hardware] = {
    "h100": Hardware("h100", 80, 989, 450, 50, 50, 2048),
    "h200": Hardware("h200", 141, 989, 450, 50, 50, 2048),
    "a100-80g": Hardware("a100-80g", 80, 312, 300, 25, 25, 2048),
    "a800": Hardware("a800", 80, 312, 200, 25, 25, 2048),
}
ALIASES = {"a100": "a100-80g", "h100-sxm": "h100", "cpu": "cpu-measured"}


def hardware_names() -> list[str]:
    """The preset names `--hardware` accepts (besides a TOML file)."""
    return [*PRESETS, "cpu-measured"]


def get_hardware(name: str, world: int = 4) -> Hardware:
    """A hardware preset; 'cpu-measured' (or 'cpu') calibrates this machine for `world` processes
    (each gets 1 / world of its memory and, past its cores, of its FLOP/s)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu-measured":
        return calibrate(world=world)
    if key not in PRESETS:
        close = difflib.get_close_matches(key, hardware_names(), n=1)
        raise ConfigError(
            f"unknown hardware '{name}'. Known hardware: {', '.join(hardware_names())}"
            + (f". Did you mean '{close[0]}'?" if close else ".")
            + " Describe other hardware with --hardware FILE.toml (a [hardware] table) or --hw KEY=VALUE."
        )
    return PRESETS[key]


def calibrated_world(hw: Hardware) -> int | None:
    """The processes a CPU calibration (calibrate(), kept by --calibrate-out) was measured for, from its
    source ("measured: N processes x 1 thread ..."), or None for hardware that records none."""
    match = re.match(r"measured: (\d+) processes", hw.source or "") if hw.is_cpu else None
    return int(match.group(1)) if match else None


def is_hardware_file(spec: str) -> bool:
    """Whether `--hardware spec` names a TOML file rather than a preset."""
    return spec.lower().endswith(".toml") or os.sep in spec or "/" in spec or os.path.isfile(spec)


def _field_types() -> dict[str, type]:
    return {f.name: (f.type if isinstance(f.type, type) else {"str": str, "float": float, "int": int}[f.type])
            for f in dataclasses.fields(Hardware)}


def _field_value(key: str, typ: type, value):
    """`value` as the field's type. An integer field (dtype_bytes, group_ranks) takes whole numbers
    only: 2.5 would otherwise be planned as 2, silently. A file's true / false, or a number for a name, is
    refused as well (float(True) planned `host_memory_gib = true` as 1 GiB)."""
    if isinstance(value, bool) or (typ is str and not isinstance(value, str)):
        raise ConfigError(f"hardware field '{key}' must be {'a string' if typ is str else 'a number'}, got "
                          f"{value!r} ({type(value).__name__}).")
    try:
        if typ is str:
            return value
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"hardware field '{key}' must be {typ.__name__}, got {value!r}.") from None
    if typ is int:
        if not number.is_integer():
            raise ConfigError(f"hardware field '{key}' must be a whole number, got {value!r}.")
        return int(number)
    return number


def apply_overrides(hw: Hardware, values: dict) -> Hardware:
    types = _field_types()
    changes = {}
    for key, value in values.items():
        if key == "base":
            continue
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            raise ConfigError(
                f"unknown hardware field '{key}'. Valid fields: {', '.join(types)}"
                + (f". Did you mean '{close[0]}'?" if close else ".")
            )
        typ = types[key]
        v = _field_value(key, typ, value)
        if typ in (int, float) and (not math.isfinite(v) or v < 0):
            raise ConfigError(f"hardware field '{key}' must be a non-negative number, got {value!r}.")
        changes[key] = v
    if not changes:
        return hw
    # a file written by `longctx plan --calibrate-out` names its own source (was: two values for it, a TypeError)
    source = changes.pop("source", None)
    return hw.replace(**changes, source=hw.source + " + overrides" if source is None else source)


def parse_kv(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--hw takes KEY=VALUE (e.g. --hw memory_gib=64), got '{item}'.")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def load_hardware(spec: str = "h100", overrides: list[str] | None = None, world: int = 4) -> Hardware:
    """`spec` (a preset name, or a TOML file whose [hardware] table gives fields, on top of a preset
    named by `base = "h100"` or complete), then --hw KEY=VALUE strings. world: the processes on this
    machine that a 'cpu-measured' base is calibrated for (the plan's ranks in one node)."""
    values: dict = {}
    file, base = None, spec
    if is_hardware_file(spec):
        file = spec
        data = read_toml(file, "--hardware file", f"Pass a preset ({', '.join(hardware_names())}) or a TOML file "
                                                     f"with a [hardware] table.")
        outside = [k for k in data if k != "hardware"] if "hardware" in data else []
        if outside:  # read only [hardware]: a field above it (or another table) would be silently ignored
            raise ConfigError(f"hardware file '{file}' has {', '.join(outside)} outside its [hardware] table; move "
                              f"every field into [hardware] (or drop the table header and give the fields alone).")
        values = dict(data.get("hardware", data))
        if "base" not in values and "name" not in values:
            raise ConfigError(f"hardware file '{file}' must name a base preset (base = \"h100\") or give every field.")
        base = values.get("base")
    if base:
        hw = get_hardware(base, world)
    else:
        types = _field_types()
        missing = [k for k in ("name", "memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "host_link_gbps",
                               "host_memory_gib") if k not in values]
        if missing:
            raise ConfigError(f"hardware file '{file}' lacks {', '.join(missing)} and names no base preset.")
        hw = Hardware(**{k: _field_value(k, types[k], values[k]) for k in values if k in types and k != "base"})
    hw = apply_overrides(hw, values)
    return apply_overrides(hw, parse_kv(overrides))


# ----------------------------------------------------------------------------------------------
# Calibration of this machine


def _attention_seconds(seq: int, heads: int, head_dim: int, repeats: int = 3) -> float:
    """Best time of one causal attention forward + backward."""
    # torch only where this machine is measured: `longctx` builds the plan parser (hardware names)
    # for every command, `data build` included, which must not load torch
    import torch

    from ..ops.attention import attention

    q, k, v = (torch.randn(1, seq, heads, head_dim, requires_grad=True) for _ in range(3))
    best = math.inf
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out, _ = attention(q, k, v, causal=True)
        out.sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def _attention_flops(seq: int = 2048, heads: int = 4, head_dim: int = 32) -> float:
    """Model FLOP/s of causal attention forward + backward: 3 x 4 x seq^2 x heads x head_dim,
    halved (causal). Documents need no term of their own: the kernels run only the same-document
    segment pairs (ops/segments.py), at the rate of causal attention, and the planner scales the
    attention FLOPs by the documents' share of the causal pairs (cost.estimate's doc_work)."""
    causal = _attention_seconds(seq, heads, head_dim)
    return 3 * 4 * seq * seq * heads * head_dim * 0.5 / causal


def _bandwidth_worker(nbytes: int, repeats: int):
    """Bytes per second this rank sends in an all-to-all and in a ring hop (send to the next rank,
    receive from the previous one), through comm.py, whose counters give the bytes sent."""
    import torch  # (lazy: see _attention_seconds)

    from ..job import comm

    mesh = comm.world_mesh()
    rank, world = mesh.get_rank(), mesh.size()
    x = torch.empty(world, nbytes // 4 // world, dtype=torch.float32)
    out = torch.empty_like(x)
    res = {}
    for name in ("all_to_all", "p2p"):
        best, sent = math.inf, 0
        for _ in range(repeats + 1):
            comm.barrier(mesh)
            comm.reset_counters()
            t0 = time.perf_counter()
            if name == "all_to_all":
                comm.all_to_all(x, mesh, label=name)
            else:
                comm.exchange(mesh, [(x, (rank + 1) % world, 0)], [(out, (rank - 1) % world, 0)], label=name).wait()
            comm.barrier(mesh)
            best = min(best, time.perf_counter() - t0)
            sent = comm.counters()["world"][name]
        res[name] = sent / best
    return res


def host_adam_rate(device_type: str) -> float:
    """1e9 parameters/s of the node's host AdamW for a run on `device_type` (memory.model_states = host /
    host_optimizer): on a CPU this machine's, by its cores (_measured_host_adam_rate); on a GPU node the field's
    default (HOST_ADAM above: an estimate until benchmarks/cpu_adam.py runs there)."""
    if device_type == "cpu":
        return _measured_host_adam_rate(os.cpu_count() or 1)
    return Hardware.host_adam_gparams_per_s


def _measured_host_adam_rate(cores: int) -> float:
    """1e9 parameters/s of the fused CPU AdamW on `cores` cores: docs/results/cpu_adam_2026-11-28.json's
    0.65 ns per parameter on 2 cores, scaled by cores (not measured again: it takes a 1.6 GB run)."""
    return 1 / 0.65 * cores / 2


def calibrate(world: int = 4, nbytes: int = 8 * 2**20, repeats: int = 3, measure_comm: bool = True) -> Hardware:
    """This machine as hardware: per-process GEMM and attention FLOP/s when `world` processes share
    it (1 thread each), gloo all-to-all and ring-hop bandwidth between `world` local processes."""
    import torch  # (lazy: see _attention_seconds)

    from .peaks import measure_cpu_gemm_peak

    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gemm = measure_cpu_gemm_peak(seconds=0.4)
        attn = _attention_flops()
    finally:
        torch.set_num_threads(threads)
    # `world` single-thread processes on `cores` cores: each gets min(1, cores / world) of a core
    share = min(1.0, cores / world)
    gemm, attn = gemm * share, attn * share
    a2a = p2p = 1.0 * GB
    if measure_comm and world > 1:
        from ..job.spawn import run_spawned  # (lazy: see _attention_seconds)

        res = run_spawned(world, _bandwidth_worker, nbytes, repeats)
        a2a = min(r["all_to_all"] for r in res)
        p2p = min(r["p2p"] for r in res)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem_gib = 16.0
    # One "node" = this machine; its RAM is both the processes' memory and the host memory, so each of
    # `world` processes gets 1/world of it and offload gains nothing (host_link_gbps is a memcpy).
    return Hardware(
        name="cpu-measured", memory_gib=mem_gib / world, peak_tflops=gemm / 1e12,
        intra_gbps=p2p / GB, inter_gbps=p2p / GB, host_link_gbps=5.0, all_to_all_efficiency=min(1.0, a2a / p2p),
        host_memory_gib=0.0, gemm_efficiency=1.0, attention_efficiency=attn / gemm, comm_overlap=0.0,
        usable_memory_fraction=0.9, usable_host_fraction=0.0, dtype_bytes=4,
        host_adam_gparams_per_s=_measured_host_adam_rate(cores),
        source=f"measured: {world} processes x 1 thread on {cores} cores; all-to-all {a2a / GB:.2f} GB/s, "
               f"ring hop {p2p / GB:.2f} GB/s",
    )
