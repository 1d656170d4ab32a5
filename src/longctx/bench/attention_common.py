"""What the attention benchmarks share: dtypes, the default length, random q/k/v, best-of timing."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import date

import torch

from ..job import comm
from ..job.devices import machine_record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SEQ_LEN = 8192


def random_qkv(args, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    q = torch.randn(args.micro_batch, args.seq_len, args.heads, args.head_dim, generator=gen).to(dtype)
    k = torch.randn(args.micro_batch, args.seq_len, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    v = torch.randn(args.micro_batch, args.seq_len, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    return q, k, v


def best_time(fn, repeats, sync=None):
    """(wall s, process CPU s) of fn(), each the best of `repeats` on its own (the CPU figure is not
    the CPU time of the fastest wall-clock repeat: callers compare CPU seconds)."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        if sync:
            sync()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu = time.process_time() - c0  # before the trailing barrier: waiting for slower ranks is not work
        if sync:
            sync()
        best = (min(best[0], time.perf_counter() - w0), min(best[1], cpu))
    return best


def machine_load() -> dict:
    """How busy the machine is: 1-minute load average and the pytest processes running."""
    try:
        pids = subprocess.run(["pgrep", "-f", "pytest"], check=False, capture_output=True, text=True,
                              timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pids = None
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "pytest_processes": None if pids is None else len(pids)}


def machine_summary(load_start: dict) -> dict:
    """Where and when the figures were measured (the date too: a JSON compared with another names its day)."""
    end = machine_load()
    return {"date": date.today().isoformat(), **machine_record(),
            "loadavg_1m_start": load_start["loadavg_1m"], "loadavg_1m_end": end["loadavg_1m"],
            "pytest_processes_start": load_start["pytest_processes"], "pytest_processes_end": end["pytest_processes"]}


# the arguments every attention benchmark records in its JSON
CONFIG_KEYS = ("world", "head", "ctx", "window", "placement", "seq_len", "micro_batch", "heads", "kv_heads", "head_dim",
               "causal", "dtype", "threads", "repeats")


def time_distributed(call, repeats: int, barrier) -> dict:
    """Forward and backward of `call()` (distributed attention on this rank) timed best-of-`repeats`
    between barriers, after one warm-up whose bytes are returned: {fwd/bwd wall and CPU s, bytes}."""
    state = {}

    def forward():
        state["out"] = call()

    def backward():
        state["out"].backward(state["grad"], retain_graph=True)

    comm.reset_counters()  # warm-up, and one measured call's bytes
    forward()
    state["grad"] = torch.ones_like(state["out"])
    backward()
    sent = comm.counters()
    fwd = best_time(forward, repeats, barrier)
    forward()
    bwd = best_time(backward, repeats, barrier)
    return {"fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0], "bwd_cpu_s": bwd[1], "bytes": sent}
