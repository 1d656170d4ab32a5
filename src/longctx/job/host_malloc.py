"""glibc malloc settings for CPU runs: keep freed large blocks for reuse, or return them at once.

By default glibc serves every allocation above its mmap threshold with a fresh mmap and returns it
to the kernel on free, but the threshold is dynamic: each freed mmapped block raises it (up to 32
MiB on 64-bit), after which blocks of that size come from the heap and stay there when freed.

- `keep_freed_blocks` (the device tier's CPU runs): a training step at long context allocates and
  frees many large tensors (a [16K tokens, 512] fp32 activation is 32 MiB), so under the default
  every step faults their pages in again, zero-filled by the kernel: at 16K tokens that is 15-30% of
  a layer's CPU time (docs/benchmarks.md, Mixture of Experts). Raising the mmap threshold and the
  trim threshold lets freed blocks stay in the heap for the next tensor of the size, as PyTorch's
  caching allocator does on a GPU. The RSS then no longer falls between steps.
- `return_freed_blocks` (the host tiers, memory.model_states host_optimizer / host): host memory is
  the budget they plan, and kept blocks cost it dearly there: FSDP's per-unit gather and reduce
  buffers, freed between long-lived gradient shards and AdamW moments, leave holes the heap cannot
  give back (834 MiB over the live bytes for small-100m under `host`, docs/memory.md). A fixed
  128 KiB mmap threshold (setting it turns the dynamic one off) returns every large block on free,
  so the RSS peak is the live peak the preflight predicts.

Set through mallopt at run time, once per process, on CPU runs only, and never over a
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ that the user set in the environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed
RETURN_BYTES = 128 << 10  # glibc's initial threshold, fixed: larger blocks are mmapped and unmapped on free

_applied: str | None = None


def keep_freed_blocks() -> str:
    """Apply the keeping setting (idempotent: a process's first setting stays); returns what the
    process runs with, for the run's log: "kept up to 1 GiB", "environment (...)", or why nothing was
    changed."""
    return _once(KEEP_BYTES, f"freed blocks up to {KEEP_BYTES >> 30} GiB kept for reuse")


def return_freed_blocks() -> str:
    """Apply the returning setting (idempotent, as keep_freed_blocks)."""
    return _once(RETURN_BYTES, f"freed blocks over {RETURN_BYTES >> 10} KiB returned to the kernel")


def _once(threshold: int, done: str) -> str:
    global _applied
    if _applied is None:
        _applied = _apply(threshold, done)
    return _applied


def _apply(threshold: int, done: str) -> str:
    mine = {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ}
    if mine:
        return "environment (" + ", ".join(f"{k}={v}" for k, v in mine.items()) + ")"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "unchanged (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold)):
        return "unchanged (mallopt refused the thresholds)"
    return done
