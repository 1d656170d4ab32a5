"""`bench train` compares layouts by tokens/s, and a process's CPU threads set its rate: the single
process took as many threads as cores sat idle in the 0.3 s before it started (threads.fit_to_idle_cores),
so beside another load it ran on fewer cores than docs/benchmarks.md says ("the single process uses both
cores") and the ratio to it moved with the load, the JSON saying nothing. Each run now gets its share of
the cores (the user's OMP_NUM_THREADS where set) and its row says how many."""

import json
import subprocess
from pathlib import Path

import pytest

from longctx import threads
from longctx.bench import train as bench_train


def fake_train(seen):
    def run(cmd, **kw):
        seen.append(cmd)
        run_dir = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("--train.run_dir=")))
        lines = [{"kind": "train", "step": s, "tokens_per_s": 100.0, "mfu": None, "memory_gib": 0.5, "loss": 1.0}
                 for s in (1, 2, 3)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    return run


@pytest.mark.parametrize("env, expect", [(None, {"single": 8, "ctx4": 2, "dp2-ctx2": 2}),
                                         ("1", {"single": 1, "ctx4": 1, "dp2-ctx2": 1})])
def test_each_run_gets_its_share_of_the_cores_and_says_it(monkeypatch, env, expect):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.delenv("LONGCTX_THREADS_FROM", raising=False)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    seen = []
    monkeypatch.setattr(bench_train.subprocess, "run", fake_train(seen))
    for layout, n in expect.items():
        row = bench_train.run_one("debug", 256, layout, 3, 2)
        assert row["threads_per_rank"] == n
        assert [a for a in seen[-1] if a.startswith("--threads")] == [f"--threads={n}"]
