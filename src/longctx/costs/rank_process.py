"""A started rank's own host memory before any of its run's bytes: the Python interpreter with torch and longctx
imported, one figure that the planner's host/node (every rank of a plan: planner/cost.py footprint_of) and the
preflight (train/host_budget.py check_host_memory: each rank `longctx train --nproc N` has yet to start) both count,
part "process", beside costs/cuda_runtime.py's "cuda_runtime" on a GPU, so a plan and the preflight count the same
parts.

PROCESS_BYTES is measured on this repository's CPU machine (torch 2.13.0+cpu, Python 3.11, 2026-12-06): the RSS of
`python -c "import torch, longctx.cli"` is 0.214 GiB (219.5 MiB, three runs alike), and the launcher of `longctx
train --nproc 2` holds 0.276 GiB (282.8 MiB) when its preflight checks the host memory, having imported what a rank
imports too (train/trainer.py, train/preflight.py). Rounded up to 0.3 GiB, which also matches issue 49's ranks (4
debug ranks held 1.3-1.5 GiB beside 0.12 GiB of the run's predicted bytes: 0.3 GiB each). A CUDA build of torch
imports more than the CPU build; that extra is inside CUDA_RUNTIME_BYTES already (costs/cuda_runtime.py: the GPU
run's peak, docs/results/gpu_frontier_nvidia-h200_2026-12-04.json, less this CPU machine's interpreter), so it is not
added here.

The preflight measures its launcher's own RSS where it can (the better figure on the machine itself), at most this
figure (train/host_budget.py caps it at PROCESS_BYTES): a launcher holding more (a notebook, a test worker, a CUDA
build's larger import, counted in cuda_runtime) is no rank's start, and a cap at the planner's figure keeps the
preflight's "process" part within the planner's, so a plan never fails the preflight on this part.
"""

from __future__ import annotations

GIB = 2**30
PROCESS_BYTES = int(0.3 * GIB)  # per rank (the module's docstring: 0.276 GiB measured at the launcher's check)
PROCESS = "process"  # its part's name in a rank's host bytes


def with_part(host: dict[str, float], name: str, nbytes: float) -> dict[str, float]:
    """A rank's host bytes by part and their "total" with part `name` (`nbytes`) added: each figure every rank holds
    besides its run's bytes (with_process; costs/cuda_runtime.py with_cuda_runtime)."""
    parts = {k: v for k, v in host.items() if k != "total"}
    parts[name] = float(nbytes)
    parts["total"] = sum(parts.values())
    return parts


def with_process(host: dict[str, float], process: float = PROCESS_BYTES) -> dict[str, float]:
    """A rank's host bytes by part and their "total" with the rank's interpreter (`process` bytes) added."""
    return with_part(host, PROCESS, process)
