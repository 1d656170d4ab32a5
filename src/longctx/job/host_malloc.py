"""glibc malloc settings for CPU training: keep freed large blocks for reuse.

By default glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB on
64-bit) with a fresh mmap and returns it to the kernel on free. A training step at long context
allocates and frees many such tensors (a [16K tokens, 512] fp32 activation is 32 MiB), so every
step faults all their pages in again, zero-filled by the kernel: at 16K tokens that is 15-30% of
a layer's CPU time (docs/benchmarks.md, Mixture of Experts). Raising the mmap threshold and the
trim threshold lets freed blocks stay in the heap for the next tensor of the size, as PyTorch's
caching allocator does on a GPU. The peak RSS is unchanged (what is kept was live at the peak);
the RSS just no longer falls between steps.

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

_applied: str | None = None


def keep_freed_blocks() -> str:
    """Apply the setting (idempotent); returns what the process runs with, for the run's log:
    "kept up to 1 GiB", "environment (...)", or why nothing was changed."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
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
    if not (mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)):
        return "unchanged (mallopt refused the thresholds)"
    return f"freed blocks up to {KEEP_BYTES >> 30} GiB kept for reuse"
