"""Run a function on N local gloo processes and collect each rank's return value.

For tests and benchmarks on one machine (training launches through torchrun instead). On the
first failure the other ranks are terminated (they would otherwise wait in a collective) and the
failing rank's traceback is raised in the caller.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results, threads):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        results.put((rank, True, fn(*args)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            from .launch import release_groups

            release_groups()


def run_spawned(world: int, fn, *args, threads: int = 1, timeout: float = 900.0) -> list:
    """fn(*args) on ranks 0..world-1 (gloo process group initialised); returns results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue_mod.Empty:
                raise TimeoutError(f"spawned ranks did not finish within {timeout:.0f}s "
                                   f"(finished: {sorted(out)})") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 0)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world)]
