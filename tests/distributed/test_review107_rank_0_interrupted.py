"""on_main's wait for rank 0 (runtime._wait_for_rank_0, on the job's store, with no time limit) when rank 0's work ends
in a BaseException (KeyboardInterrupt, SystemExit), which on_main does not turn into an outcome: rank 0 raised it
without setting the store's key, so a rank 0 that caught it and lived on (an embedding program, a notebook), or
exited 0, left the other ranks polling the store forever (before the store's wait they failed in the broadcast as
soon as rank 0 left: 'Connection closed by peer'). 2 gloo ranks; the groups' backstop 3 s."""

import time

from longctx.job.spawn import run_spawned


def _interrupted_on_rank_0():
    import torch.distributed as dist

    from longctx.config import load_config
    from longctx.job import watchdog
    from longctx.job.runtime import Runtime, on_main

    watchdog._GROUP_TIMEOUT_S = 3.0  # (as init_distributed sets it, short)
    rt = Runtime.create(load_config(None, ["--parallel.ctx=2"]), dist.get_rank(), dist.get_world_size(), "cpu")

    def work():
        raise KeyboardInterrupt

    start = time.monotonic()
    try:
        on_main(rt, work, "the interrupted work")
        return "returned", time.monotonic() - start
    except BaseException as e:  # (rank 0's program catches it and goes on)
        return type(e).__name__, time.monotonic() - start
    finally:
        watchdog._GROUP_TIMEOUT_S = None


def test_the_other_ranks_do_not_wait_forever_for_an_interrupted_rank_0():
    (first, _), (second, waited) = run_spawned(2, _interrupted_on_rank_0, timeout=60)
    assert first == "KeyboardInterrupt"
    assert second != "returned" and waited < 30  # (the broadcast's failure: rank 0 left, or the backstop)
