"""The link hook job/comm.py offers: what a benchmark installs (bench/emulated_link.py's LinkEmulator, through
`emulate`; training never installs one) to make comm's collectives on emulated dims take the time a modelled
cluster's links would, and `paced` compute an emulated device's. comm.py re-exports all three."""

from __future__ import annotations

# The hook answers covers(dim), post(by_peer, now) / post_ring(ranks, bytes, now) -> completion time,
# wait_until(done, started), and paced(run, x, flops) for the compute between collectives.
_LINK_HOOK = None


def set_link_hook(hook):
    """Install `hook` (None: real links only) for this process's collectives; returns the previous one."""
    global _LINK_HOOK
    previous, _LINK_HOOK = _LINK_HOOK, hook
    return previous


def link_hook():
    return _LINK_HOOK


def paced(run, x, flops: float):
    """run(x), a block of `flops` forward FLOPs between collectives, as the installed link hook paces
    it (an emulated device's compute time); just run(x) without one."""
    hook = _LINK_HOOK
    return run(x) if hook is None else hook.paced(run, x, flops)
