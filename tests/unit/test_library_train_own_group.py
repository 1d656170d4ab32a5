"""The library's train(cfg) on a rank of a process group its caller made itself (init_process_group with a store,
no launcher's RANK / WORLD_SIZE), which job/launch.py init_distributed reuses (review, 2026-12-04). train()'s
host-memory check for plain processes (issue 49 item 3) took such a rank for a one-process run: it checked the
layout on 1 rank and refused every multi-rank layout ("... but the world size is 1"), and would have counted the
whole model's states against each rank's free memory. Such ranks are a job's, as under a launcher: no check."""

import multiprocessing as mp
import os
import queue
import time

import torch.distributed as dist

from longctx.config import load_config


class _Reached(Exception):  # the Trainer was reached: train() refused nothing
    pass


def _rank(rank: int, store_path: str, run_dir: str, out) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    from longctx.train import trainer

    def fake(*a, **k):
        raise _Reached

    trainer.Trainer = fake
    try:  # (the group's set-up inside: a rank that fails to join says why at once, not after the test's wait)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        dist.barrier()  # (both joined: a rank leaving at once closed its side while the other still connected)
        cfg = load_config("configs/debug.toml", ["--parallel.dp_shard=2", "--parallel.head=1", "--parallel.ctx=1",
                                                  "--train.steps=1", "--train.eval_interval=0", "--train.device=cpu",
                                                  "--metrics.plots=false", "--metrics.progress=false",
                                                  f"--train.run_dir={run_dir}"])
        trainer.train(cfg)
        out.put((rank, "returned"))
    except _Reached:
        out.put((rank, "reached"))
    except Exception as e:  # (what the test reports)
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.barrier()  # (neither rank closes the group while the other may still use it)
            dist.destroy_process_group()


def test_ranks_of_a_callers_own_process_group_are_not_checked_as_one_process(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(tmp_path / "run"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 120
    while len(got) < len(procs):  # each rank's answer; a rank that died without one fails the test at once
        assert time.monotonic() < deadline, f"no answer from rank(s) {sorted({0, 1} - got.keys())} in 120 s"
        try:
            rank, what = out.get(timeout=5)
            got[rank] = what
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            assert not dead, f"rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]}) without an answer"
    for p in procs:
        p.join(timeout=60)
    assert got == {0: "reached", 1: "reached"}, got
