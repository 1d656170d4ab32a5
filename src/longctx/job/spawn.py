"""Run a function on N local gloo processes and collect each rank's return value.

For tests and benchmarks on one machine (training launches through torchrun instead). On the
first failure the other ranks are terminated (they would otherwise wait in a collective) and the
failing rank's traceback is raised in the caller.

The ranks are forked from a server process (multiprocessing's forkserver) that imported torch and
the longctx modules the caller has imported once, when the first job started: a fresh interpreter
per rank ("spawn") costs several seconds of imports per rank on a small CPU machine. The server
has imported modules only (no torch op run, no thread pool or process group started); each rank
gets the caller's environment and standard output/error as they are when the job starts (as a
spawned process would), its own thread count and random seeds (torch, numpy; Python's are reseeded
on fork), and a check that it runs the caller's longctx. (The ranks share the server's str hash seed.)
`run_spawned_many` runs several functions one after another in one job, all on the same process
group (training's `init_distributed` reuses a group that exists).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import comm

HOST = "127.0.0.1"


class _CallerState:
    """What a spawned rank would inherit from the caller: environment variables, standard output and
    error (file descriptors 1 and 2, duplicated into the rank when the process starts) and which
    longctx it imports."""

    def __init__(self):
        import longctx

        self.env = dict(os.environ)
        self.longctx_file = longctx.__file__

    def __reduce__(self):  # called while the rank's process starts: DupFd hands it the descriptors
        return _restore_caller_state, (self.env, self.longctx_file, reduction.DupFd(1), reduction.DupFd(2))


def _restore_caller_state(env, longctx_file, stdout, stderr):
    os.environ.clear()
    os.environ.update(env)
    for stream, fd in ((sys.stdout, stdout), (sys.stderr, stderr)):
        stream.flush()
        new = fd.detach()
        if new != stream.fileno():  # (a spawned process gets the descriptor itself)
            os.dup2(new, stream.fileno())
            os.close(new)
    import longctx

    if longctx.__file__ != longctx_file:  # (reported by _entry)
        return (f"the rank imported {longctx.__file__}, the caller {longctx_file}: the fork server was "
                "started with another import path")
    return None


def _entry(caller_problem, rank, world, port, fn, args, results, threads):
    # every rank on this machine, as torchrun says them: a LOCAL_WORLD_SIZE left in the caller's shell was this
    # job's ranks per node to the ranks (launched: job/checks.py launcher_node_ranks), not to the caller's preflight
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    # a fresh process's random seeds (forked ranks would all share the server's)
    torch.default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        if caller_problem is not None:
            raise RuntimeError(caller_problem)
        timeout = timedelta(seconds=300)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)  # the caller's (see _job_store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        # every rank's mesh made before any rank goes on: gloo's init returns on a rank once its own pairs are
        # up, so a quick fn (dist.get_rank) let it exit while a peer still shook hands with it, and the peer's
        # init failed ('Connection closed by peer'; seen on a loaded 2-core machine, 3 ranks)
        comm.barrier()
        # pickled here, with plain pickle: the queue's pickler hands a tensor over as a shared-memory file
        # descriptor that the caller fetches from this process when it reads the result, which fails
        # (ConnectionResetError, FileNotFoundError) once the rank has exited; an unpicklable result is an
        # error of this rank, not a result lost in the queue's feeder thread
        results.put((rank, True, pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            from .launch import release_groups

            release_groups()


_server_lock = threading.Lock()


def _context():
    """The forkserver context, its server running with torch and the caller's longctx modules imported
    (started on first use, or again if it died); "spawn" where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    with _server_lock:
        # "__main__" as the ranks import it (the default preload); then torch and every longctx module
        # this process has imported
        # (torch._dynamo: torch imports it lazily on the first init under a device context, 0.5 s a rank)
        preload = ["__main__", "torch", "torch.distributed", "torch._dynamo"] + sorted(
            name for name, mod in list(sys.modules.items())
            if (name == "longctx" or name.startswith("longctx.")) and mod is not None
            and not name.endswith("__main__"))
        ctx.set_forkserver_preload(preload)  # (takes effect when a server starts)
        # the server imports them from this process's import path
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = old
    return ctx


def _job_store() -> dist.TCPStore:
    """The job's rendezvous store, served by the caller on a port the system picks while binding it
    (a port found free and bound later by rank 0 could be taken in between by another job)."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))


def run_spawned(world: int, fn, *args, threads: int = 1, timeout: float = 900.0) -> list:
    """fn(*args) on ranks 0..world-1 (gloo process group initialised); returns results by rank."""
    ctx = _context()
    results = ctx.Queue()
    store = _job_store()
    port = store.port
    caller = _CallerState()  # first: the rank has the caller's environment before it imports fn's module
    procs = [ctx.Process(target=_entry, args=(caller, r, world, port, fn, args, results, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        _collect(results, procs, out, timeout)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 0)
            if p.is_alive():
                p.terminate()
        for p in procs:  # a rank in the trainer only notes SIGTERM (train/preemption.py), and one waiting on a
            p.join(timeout=5)  # dead peer never reaches the step boundary that acts on it: it outlived terminate()
            if p.is_alive():  # and the caller hung at exit joining it
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world)]


def _collect(results, procs, out: dict, timeout: float) -> None:
    """Fill `out` with each rank's result; raise on the first failure, on a rank that ended without
    reporting one (killed, os._exit, a crash in C code: waiting for it would only end at `timeout`),
    or at `timeout`."""
    world, deadline = len(procs), time.monotonic() + timeout
    while len(out) < world:
        try:
            rank, ok, value = results.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            gone = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if gone:  # (a rank's result is in the queue before it exits: one more look, then it is lost)
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue_mod.Empty:
                    r = gone[0]
                    raise RuntimeError(f"rank {r} of {world} ended with exit code {procs[r].exitcode} without "
                                       f"returning a result or an error (killed, os._exit or a crash in C code); "
                                       f"its output above says more (finished: {sorted(out)})") from None
            elif time.monotonic() >= deadline:
                raise TimeoutError(f"spawned ranks did not finish within {timeout:.0f}s "
                                   f"(finished: {sorted(out)})") from None
            else:
                continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
        out[rank] = pickle.loads(value)


def _run_many(jobs):
    """On every rank: each (key, fn, args) of `jobs` in order; {key: (result, seconds)}. Each function
    starts with comm's byte counters cleared, as in a fresh process."""
    from . import comm

    out = {}
    for key, fn, args in jobs:
        comm.reset_counters()
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:  # the traceback names the job
            raise RuntimeError(f"job {key!r} failed") from e
        out[key] = (result, time.perf_counter() - start)
        comm.barrier()  # (no rank starts the next function while another still runs this one)
    return out


def run_spawned_many(world: int, jobs, *, threads: int = 1, timeout: float | None = None,
                     seconds: dict | None = None) -> dict:
    """Run every (key, fn, args) of `jobs`, in order, in one spawned job of `world` ranks: fn(*args)
    on each rank, as `run_spawned` runs one. Returns {key: [result of rank 0, rank 1, ...]}. The
    functions must be picklable (module-level). `timeout` (default 300 s per job, at least 900 s)
    bounds the whole job; `seconds`, when given, receives {key: rank 0's seconds in fn}. Each
    function gets its own state to write (run directories), as separate jobs would; what a
    process keeps between them (torch's RNG, caches) is the functions' to reset, as training does.
    """
    jobs = [(key, fn, tuple(args)) for key, fn, args in jobs]
    keys = [key for key, _, _ in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"job keys must be distinct: {keys}")
    if timeout is None:
        timeout = max(900.0, 300.0 * len(jobs))
    per_rank = run_spawned(world, _run_many, jobs, threads=threads, timeout=timeout)
    if seconds is not None:
        seconds.update({key: per_rank[0][key][1] for key in keys})
    return {key: [r[key][0] for r in per_rank] for key in keys}
