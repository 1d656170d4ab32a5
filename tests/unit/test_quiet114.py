"""Two leftovers (quiet114).

1. A run ends what it started. memory.model_states = host at world 1 makes a process group of this process alone
   (FSDP2's CPU offload needs one: job/join.py). train() called in process (a notebook, a test) ended it only when
   the run failed: a finished run left it, the next run in the process reused a group nobody owned, and
   tests/conftest.py's guard ended it before the next module with a warning. A group the caller made before the run
   is the caller's: it stays, and the run trains in it.
2. `longctx bench memory`'s timing (every timed policy's warm-up step, then the policies taking turns step by step)
   ran in a phase with no count: a long timing at a long length said only "[12m]". It counts its steps now.

Counts are watched through a Phase that records every value its count takes (tests/phase_spy.py); no timing is
asserted."""

import json
import math

import pytest
import torch.distributed as dist

from longctx import progress
from longctx.cli import main
from longctx.config import load_config
from longctx.train.trainer import train
from phase_spy import record_phases

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=1", "--train.steps=2",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=50"]


def _quiet(*_a, **_k):
    pass


def _train(run_dir, tier: str):
    cfg = load_config("configs/debug.toml", [*TINY, f"--memory.model_states={tier}", f"--train.run_dir={run_dir}"])
    return train(cfg, log=_quiet)


def test_in_process_host_runs_each_end_the_group_they_made(tmp_path):
    assert not dist.is_initialized()
    for i in range(2):  # (the second starts as the first did: no group of the first's left to reuse)
        result = _train(tmp_path / f"host{i}", "host")
        assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
        assert not dist.is_initialized(), f"in-process run {i + 1} under host left its one-rank process group"
    result = _train(tmp_path / "host_optimizer", "host_optimizer")  # (makes no group at world 1: none left either)
    assert len(result.losses) == 2 and not dist.is_initialized()


def test_a_group_the_caller_made_stays_and_the_run_trains_in_it(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mine = dist.group.WORLD
    try:
        result = _train(tmp_path / "run", "host")
        assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
        assert dist.is_initialized() and dist.group.WORLD is mine, "the run ended the caller's own group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_bench_memorys_timing_counts_its_steps_to_the_whole(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(progress.INTERVAL_ENV, "1000")  # (lines on: this process speaks; none falls due here)
    monkeypatch.delenv("RANK", raising=False)
    made = record_phases(monkeypatch.setattr)
    assert main(["bench", "memory", "--preset", "debug", "--layers", "1", "--seq-len", "64", "--policies",
                 "none,full", "--time-steps", "2", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(e["step_s"] > 0 for e in doc["results"][0]["policies"].values())
    timing = [p for p in made if p.what.startswith("timing")]
    assert len(timing) == 1, [p.what for p in made]
    (timing,) = timing
    # 2 policies, each a warm-up step and 2 timed steps: 6 steps, counted one by one
    assert timing.total == 6 and timing.unit == "steps"
    assert timing.values == [0, 1, 2, 3, 4, 5, 6], timing.values
