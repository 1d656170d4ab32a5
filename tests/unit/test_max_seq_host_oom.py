"""`bench memory --max-seq` reports a probe the host refuses memory to as that probe's "does not
fit (host memory)" (issue 49 item 3), by faults injected here, never by exhausting this machine."""

import argparse
import json
import os
import signal
import subprocess
import sys

import pytest

from longctx.bench import max_seq, memory


def bench_args(**changes):
    p = argparse.ArgumentParser()
    memory.add_arguments(p)
    args = p.parse_args(["--preset", "debug", "--layers", "2", "--max-seq-step", "1024"])
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def test_a_probe_killed_by_sigkill_does_not_fit_host_memory(monkeypatch):
    # a real child process killed by SIGKILL, as the OOM killer kills
    monkeypatch.setattr(max_seq, "_probe_command", lambda *a: [
        sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), {int(signal.SIGKILL)})"])
    out = max_seq._run_probe(bench_args(), "none", 4096, "cpu")
    assert out["fits"] is False and out["host_memory"] is True
    assert out["error"].startswith("does not fit (host memory)") and "SIGKILL" in out["error"]


def test_a_probe_dying_of_memory_error_does_not_fit_host_memory(monkeypatch):
    monkeypatch.setattr(max_seq, "_probe_command", lambda *a: [sys.executable, "-c", "raise MemoryError"])
    out = max_seq._run_probe(bench_args(), "none", 4096, "cpu")
    assert out["fits"] is False and out["host_memory"] is True and "MemoryError" in out["error"]


@pytest.mark.parametrize("fault", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. "
                                                                  "DefaultCPUAllocator: can't allocate memory")])
def test_the_probe_itself_answers_when_the_host_refuses(monkeypatch, fault):
    def refuse(*a, **k):
        raise fault

    monkeypatch.setattr(memory, "_build", refuse)
    out = memory._probe_step(bench_args(device="cpu"), "none", 0.0, 4096)
    assert out["fits"] is False and out["host_memory"] is True and out["error"].startswith(max_seq.HOST_OOM)


def test_other_errors_still_raise(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(memory, "_build", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        memory._probe_step(bench_args(device="cpu"), "none", 0.0, 4096)


def test_the_search_goes_on_past_a_host_kill(monkeypatch):
    """Lengths from 8K up are killed: the search reports them and answers 7K."""
    def probe(args, name, seq, device, env=None):
        if seq >= 8192:
            return {"seq_len": seq, "fits": False, "host_memory": True, "error": max_seq.HOST_OOM + ": killed"}
        return {"seq_len": seq, "peak_rss_bytes": seq}

    monkeypatch.setattr(max_seq, "_run_probe", probe)
    found = max_seq.longest_sequence_cpu(bench_args(), "none", budget=1 << 40)
    assert found["longest_seq_len"] == 7168
    killed = [p for p in found["probes"] if p.get("host_memory")]
    assert killed and all(p["fits"] is False for p in killed)


def test_the_command_line_probe_prints_the_host_answer(monkeypatch, tmp_path):
    """End to end through `longctx bench memory --probe` in a subprocess, the fault injected by a
    sitecustomize that makes building the model raise MemoryError."""
    (tmp_path / "sitecustomize.py").write_text(
        "import longctx.bench.memory as m\n"
        "def _refuse(*a, **k):\n    raise MemoryError\n"
        "m._build = _refuse\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "longctx", "bench", "memory", "--probe", "none:2048", "--device",
                          "cpu", "--preset", "debug", "--layers", "2"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["fits"] is False and out["host_memory"] is True
