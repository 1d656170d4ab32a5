"""A CUDA rank's host memory besides its interpreter and its run's bytes: the CUDA context and the libraries it
loads (the CUDA runtime, cuBLAS, cuDNN, NCCL, the kernels' modules), one figure that the planner's host/node (every
rank of a GPU plan: planner/cost.py footprint_of) and the preflight (train/host_budget.py check_host_memory: each
rank whose context is not made yet) both add, part "cuda_runtime", so a plan and the preflight agree.

CUDA_RUNTIME_BYTES comes from the one measurement we have, docs/results/gpu_frontier_nvidia-h200_2026-12-04.json
`smoke.device.host_peak_gib` = 1.39: the peak RSS of `longctx train --nproc 1` training the debug model 30 steps
under memory.model_states = device on an H200 (torch 2.11 + CUDA 13). The same command on this repository's CPU
machine (torch 2.13 CPU build, 2026-12-06, fresh data cache) peaks at 0.54 GiB, of which 0.11 GiB are the run's
device bytes in host memory (train/host_budget.py's "device (CPU: host memory)" part, which the GPU holds on the
device): 1.39 - (0.54 - 0.11) = 0.96 GiB is what the GPU run held besides the interpreter, the launcher's work and
the run's host bytes (~0.2 MiB: its data loader). Rounded down to 0.95 GiB. A CUDA build of torch imports more
than a CPU build: that extra is in this figure, and the "process" part beside it (costs/rank_process.py: the
planner's figure, and the preflight's launcher RSS capped at it) is a CPU build's interpreter, so it is counted
once. benchmarks/gpu_frontier.py re-measures it on each lent GPU
(`cuda_process`: a process that makes the context, runs one cuBLAS matmul and one SDPA call).
"""

from __future__ import annotations

from .rank_process import with_part

GIB = 2**30
CUDA_RUNTIME_BYTES = int(0.95 * GIB)  # per rank on a GPU (the module's docstring: 1.39 - (0.54 - 0.11) GiB)
CUDA_RUNTIME = "cuda_runtime"  # its part's name in a rank's host bytes


def with_cuda_runtime(host: dict[str, float]) -> dict[str, float]:
    """A rank's host bytes by part and their "total" with the CUDA rank's context and libraries added."""
    return with_part(host, CUDA_RUNTIME, CUDA_RUNTIME_BYTES)
