"""parallel.spawn: ranks forked from the preloaded server start as spawned processes would, with the
caller's environment and output as they are when the job starts, their own threads and random seeds."""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from longctx.job.spawn import run_spawned


def _what_a_rank_sees():
    rank = dist.get_rank()
    # one write per line: print() writes the text and its newline apart, and with PYTHONUNBUFFERED two
    # ranks' lines can interleave on the shared pipe ("out from rank 1out from rank 0\n\n")
    for stream, what in ((sys.stdout, "out"), (sys.stderr, "err")):
        stream.write(f"{what} from rank {rank}\n")
        stream.flush()
    return (os.environ.get("LONGCTX_TEST_SPAWN"), "LONGCTX_TEST_SPAWN_GONE" in os.environ, torch.get_num_threads(),
            torch.initial_seed(), int(np.random.randint(2**31)), os.getcwd())


def test_ranks_get_the_callers_state_when_the_job_starts(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("LONGCTX_TEST_SPAWN_GONE", "1")
    run_spawned(2, dist.get_rank)  # the server runs (started here or by an earlier job)
    monkeypatch.setenv("LONGCTX_TEST_SPAWN", "set after the server started")
    monkeypatch.delenv("LONGCTX_TEST_SPAWN_GONE")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    ranks = run_spawned(3, _what_a_rank_sees, threads=2)
    assert [r[:3] for r in ranks] == [("set after the server started", False, 2)] * 3
    assert all(r[5] == str(tmp_path) for r in ranks)
    assert len({r[3] for r in ranks}) == 3 and len({r[4] for r in ranks}) == 3  # seeds of fresh processes
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == [f"out from rank {r}" for r in range(3)]
    assert sorted(line for line in err.splitlines() if "from rank" in line) == [f"err from rank {r}" for r in range(3)]
