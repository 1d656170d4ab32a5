"""CPU threads of a longctx process: chosen before torch loads, and said.

OpenMP (torch's CPU thread pool) reads OMP_WAIT_POLICY and OMP_NUM_THREADS once, when its library
loads, so this runs first thing in `longctx`'s main, before any torch import. The one setting that
matters is the wait policy: by default an OpenMP thread that finishes its share spins for a while
before it sleeps. On an idle machine that saves a wake-up; beside a competing load the spinning
threads take the cores the working thread needs, and a debug-moe run on a loaded 2-core machine fell
from 7,238 tokens/s to 420 (17x; 29x in the report that found it). With PASSIVE the same run kept
its speed (docs/benchmarks.md). A process therefore waits passively unless the environment says
otherwise. The count: `--threads N` (or OMP_NUM_THREADS) where given; each of N local ranks its
share of the cores (job/relaunch.py); one process alone as many threads as cores sat idle in the
0.3 s before it started (fit_to_idle_cores), so that a thread team does not wait at every parallel
region for a member the scheduler put aside. `describe` says which, on the run's setup line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

WAIT_ENV, THREADS_ENV = "OMP_WAIT_POLICY", "OMP_NUM_THREADS"
HELP = ("CPU threads per process (default: torch's, one per core; a multi-rank launch gives each rank its "
        "share); OpenMP waits passively unless OMP_WAIT_POLICY says otherwise (longctx/threads.py)")
_FROM = "LONGCTX_THREADS_FROM"  # where the count came from, for the line that says it (inherited by ranks)
_IDLE = "LONGCTX_THREADS_IDLE"  # the idle cores fit_to_idle_cores saw


def threads_given(argv: Sequence[str]) -> int | None:
    """`--threads N` or `--threads=N` anywhere in argv (each command that runs models declares it for
    its help; this reads it before the parser, which may import torch). Given twice, the last one, as
    argparse reads it (the first ran the process beside an args.threads of the last: bench moe's torch)."""
    found = None
    for i, arg in enumerate(argv):
        value = None
        if arg == "--threads" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
        if value is not None:
            if not re.fullmatch(r"[1-9][0-9]*", value):
                from .errors import ConfigError

                raise ConfigError(f"--threads takes a positive number of CPU threads per process, got {value!r}.")
            found = int(value)
    return found


def configure(argv: Sequence[str]) -> None:
    """Set OpenMP's wait policy and thread count for this process and the ranks it starts."""
    os.environ.setdefault(WAIT_ENV, "PASSIVE")
    given = threads_given(argv)
    if given is not None:
        os.environ[THREADS_ENV] = str(given)
        os.environ[_FROM] = "--threads"
    elif THREADS_ENV in os.environ:
        os.environ.setdefault(_FROM, THREADS_ENV)


def share_cores(nproc: int) -> None:
    """A launch of `nproc` local ranks: each gets its share of the cores unless a count was given. The cores this
    process may run on (its affinity: a Slurm cpuset, taskset, a container's --cpuset-cpus), as fit_to_idle_cores
    counts them, not the machine's: 4 ranks on 8 of a node's 128 cores ran 32 threads each on 2."""
    if THREADS_ENV not in os.environ:
        os.environ[THREADS_ENV] = str(max(1, usable_cores() // nproc))
        os.environ[_FROM] = "share"


def usable_cores() -> int:
    """The cores this process may run on (os.cpu_count() where the system has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times(cpus: set[int]) -> tuple[float, float]:
    """(idle, total) jiffies of these CPUs since boot, from /proc/stat."""
    idle = total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [float(v) for v in fields[:8]]
                idle += values[3] + values[4]  # idle + iowait
                total += sum(values)
    return idle, total


def idle_cores(sample_s: float = 0.3) -> float | None:
    """How many of this process's usable cores sat idle over `sample_s` (None where /proc/stat is not)."""
    import time

    try:
        cpus = os.sched_getaffinity(0)
        idle0, total0 = _cpu_times(cpus)
        time.sleep(sample_s)
        idle1, total1 = _cpu_times(cpus)
    except (OSError, AttributeError, ValueError):
        return None
    return len(cpus) * (idle1 - idle0) / (total1 - total0) if total1 > total0 else None


def fit_to_idle_cores(sample_s: float = 0.3) -> None:
    """One process alone (not a rank, no --threads or OMP_NUM_THREADS): as many threads as cores are
    idle now, at least one. Beside a competing load, a team of threads as wide as the machine waits at
    every parallel region for its member that the scheduler put aside; a narrower team does not."""
    if os.environ.get(_FROM):
        return
    free = idle_cores(sample_s)
    if free is None:
        return
    import torch

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, min(cores, round(free))))
    os.environ[_FROM] = "idle"
    os.environ[_IDLE] = f"{free:.1f} of {cores}"


def describe() -> str:
    """'2 threads (one per core; --threads sets it), OpenMP wait passive': for a run's setup line."""
    import torch

    n = torch.get_num_threads()
    source = os.environ.get(_FROM)
    why = {"--threads": "--threads", THREADS_ENV: THREADS_ENV, "share": "this rank's share of the cores",
           "idle": f"{os.environ.get(_IDLE)} cores idle at start; --threads sets it"}.get(
        source or "", "torch's default; --threads sets it")
    wait = os.environ.get(WAIT_ENV, "OpenMP's default").lower()
    return f"{n} CPU thread{'s' if n != 1 else ''} ({why}), OpenMP wait {wait}"
