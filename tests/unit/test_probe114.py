"""benchmarks/gpu_frontier.py's cuda_process probe, run here on the CPU: the process it starts imports what a
rank imports (torch and longctx), and that process's RSS is within the planner's and the preflight's "process"
figure (costs/rank_process.py PROCESS_BYTES), so the figure is not below what a rank's start measures here. On
a lent GPU the same probe records a CUDA build's figure beside it (process_constant_gib)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from longctx.costs.rank_process import PROCESS_BYTES

ROOT = Path(__file__).parents[2]


def _frontier():
    spec = importlib.util.spec_from_file_location("gpu_frontier_probe114", ROOT / "benchmarks/gpu_frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probe_imports_a_ranks_modules():
    # (the probe's source, run up to its imports with a module that records what it imported)
    imports = _frontier().CUDA_PROCESS.split("def peak_gib")[0]
    done = subprocess.run([sys.executable, "-c", imports + "\nimport sys; print('longctx.cli' in sys.modules)"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.split()[-1] == "True"


def test_the_process_figure_covers_what_the_probe_measures_here(monkeypatch):
    frontier = _frontier()
    monkeypatch.setattr(frontier, "DEVICE", "cpu")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    got = frontier.cuda_process()
    assert "rc" not in got, got
    # a real interpreter with torch imported is more than 0.1 GiB; the figure must hold what this machine's holds
    assert 0.1 < got["imports_gib"] <= PROCESS_BYTES / 2**30, got
    assert got["cuda_process_gib"] <= got["counted_gib"], got  # (here no CUDA: the imports and two CPU calls)


def test_a_probe_started_by_a_large_process_measures_its_own_size():
    """ru_maxrss is kept across exec: a probe forked from a test worker (2.9 GiB) read the worker's size as its own.
    Here a parent holding 1 GiB starts the probe, which must still measure its own imports."""
    frontier = str(ROOT / "benchmarks/gpu_frontier.py")
    parent = ("import importlib.util, json, sys\n"
              "held = bytearray(2**30)\n"
              "for i in range(0, len(held), 4096): held[i] = 1\n"
              f"spec = importlib.util.spec_from_file_location('frontier', {frontier!r})\n"
              "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
              "module.DEVICE = 'cpu'\n"
              "print(json.dumps(module.cuda_process()))\n")
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-800:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["imports_gib"] < 0.6 and got["cuda_process_gib"] < 0.6, got  # (the parent: over 1 GiB)
