"""The job floor on real gloo ranks (job audit):
- spawn.run_spawned names a rank that ended without a result (killed, os._exit, a crash in C code) at
  once, with its exit code; it waited the whole timeout (900 s by default) and then said only that
  the ranks did not finish;
- the hang watchdog fires on a rank blocked in the ring's point-to-point wait (comm.exchange's
  Pending.wait: a real gloo Work.wait(), no torch.distributed frame on the stack).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from longctx.job import comm, watchdog
from longctx.job.spawn import run_spawned
from longctx.job.watchdog import Watchdog


def _rank1_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    return "finished"


def test_a_rank_that_dies_without_a_result_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 ended with exit code 3 without returning a result"):
        run_spawned(2, _rank1_dies, timeout=60)
    assert time.monotonic() - start < 45  # (the ranks' start included; it waited all 60 s)


def _ring_wait_with_a_late_peer():
    """Rank 0 waits for a tensor that rank 1 sends 3 s late; rank 0's watchdog (1 s) must fire."""
    mesh = comm.world_mesh()
    if dist.get_rank() == 1:
        time.sleep(3.0)
        comm.exchange(mesh, sends=[(torch.ones(4), 0, 0)]).wait()
        return None
    buf = torch.zeros(4)
    w = Watchdog(1.0, rank=0, folder=None, exit_process=False).start()
    try:
        watchdog.phase(1, "forward")
        comm.exchange(mesh, recvs=[(buf, 1, 0)]).wait()
    finally:
        w.stop()
    return w.fired.is_set(), buf.tolist()


def test_the_watchdog_fires_in_a_real_ring_wait():
    fired, received = run_spawned(2, _ring_wait_with_a_late_peer)[0]
    assert fired and received == [1.0] * 4
