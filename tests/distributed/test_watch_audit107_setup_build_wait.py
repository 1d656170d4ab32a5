"""Rank 0's long work at set-up (on_main: a first build of the data store from data.corpus, which under torchrun
started directly no launcher's preflight did) while the other ranks wait for it. No watchdog runs in set-up, and the
waiting ranks waited in a broadcast, which gives up at the process groups' backstop (parallel.timeout_s + grace +
30 s: 340 s by default): a build longer than that ended the job with gloo's 'Timed out waiting 340000ms for recv
operation' on the waiting ranks and 'Connection closed by peer' on rank 0, a traceback that named no data build.
Here the backstop is 3 s (as if set by init_distributed) and rank 0 works 6 s; 2 gloo ranks."""

import time

from longctx.job.spawn import run_spawned


def _set_up_with_a_long_build(work_s: float):
    from longctx.config import load_config
    from longctx.job import watchdog
    from longctx.job.runtime import Runtime, on_main

    watchdog._GROUP_TIMEOUT_S = 3.0  # the backstop the job's groups wait (init_distributed sets it: timeout_s + 32 s)
    rt = Runtime.create(load_config(None, ["--parallel.ctx=2"]), *_rank_and_world(), "cpu")

    def build():
        time.sleep(work_s)  # a data build longer than the backstop
        return "stores/built"

    try:
        return on_main(rt, build, "building the data store"), rt.broadcast("after")  # (and the group still works)
    except Exception as e:  # (the rank's error, to the test)
        return f"{type(e).__name__}: {e}"
    finally:
        watchdog._GROUP_TIMEOUT_S = None


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_ranks_wait_for_rank_0s_set_up_work_past_the_backstop():
    assert run_spawned(2, _set_up_with_a_long_build, 6.0) == [("stores/built", "after")] * 2
