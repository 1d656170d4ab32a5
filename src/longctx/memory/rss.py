"""This process's resident memory, as the benchmarks and the training metrics read it.

The peak is VmHWM from /proc/self/status, not getrusage's ru_maxrss: Linux carries ru_maxrss over
an exec (a probe started from a 900 MB pytest process would report 900 MB), while VmHWM belongs to
the process's own address space and starts at zero with it. Elsewhere ru_maxrss is the fallback.
"""

from __future__ import annotations

import resource
import sys


def proc_status_kib() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process in KiB; empty where /proc is absent."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def current_rss_bytes() -> int:
    """The resident memory this process holds now, in bytes (0 where /proc is absent)."""
    return proc_status_kib().get("VmRSS", 0) * 1024


def peak_rss_bytes() -> int:
    """The most resident memory this process has held, in bytes."""
    hwm = proc_status_kib().get("VmHWM")
    if hwm is not None:
        return hwm * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM and ru_maxrss) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
