"""CPU threads are chosen before torch loads (longctx/threads.py): OpenMP waits passively unless the
environment says otherwise, --threads sets the count, and the line a run prints says both."""

import os
import subprocess
import sys

import pytest

from longctx.errors import ConfigError
from longctx.threads import threads_given


def test_threads_flag_is_read_in_both_forms_and_checked():
    assert threads_given(["train", "--threads", "3"]) == 3
    assert threads_given(["generate", "--threads=2", "--prompt", "x"]) == 2
    assert threads_given(["train", "--train.steps", "3"]) is None
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="--threads takes a positive number"):
            threads_given(["train", "--threads", bad])


def _probe(argv: list[str], env: dict) -> str:
    code = ("import sys; from longctx import threads; threads.configure(sys.argv[1:]); import torch; "
            "import os; print(torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY'), '|', threads.describe())")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                               "LONGCTX_THREADS_FROM")}
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env={**clean, **env},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_configure_sets_the_wait_policy_and_the_count_before_torch_loads():
    out = _probe(["train", "--threads", "1"], {})
    assert out.startswith("1 PASSIVE |") and "1 CPU thread (--threads), OpenMP wait passive" in out
    # the environment's own choices are kept and named
    out = _probe(["train"], {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"})
    assert out.startswith("1 ACTIVE |") and "(OMP_NUM_THREADS), OpenMP wait active" in out
    out = _probe(["train"], {})
    assert " PASSIVE |" in out and "torch's default; --threads sets it" in out


def test_the_cli_refuses_a_bad_thread_count_before_work():
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--threads", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--threads takes a positive number" in r.stderr, r.stderr


def test_one_process_fits_its_threads_to_the_idle_cores(monkeypatch):
    """fit_to_idle_cores: as many threads as cores sat idle (at least one, at most the usable
    cores), said as such; a count given by --threads or the environment is left alone."""
    import torch

    from longctx import threads

    before = torch.get_num_threads()
    monkeypatch.delenv("LONGCTX_THREADS_FROM", raising=False)
    try:
        for idle, expected in ((0.2, 1), (1.4, 1), (1.6, 2), (40.0, len(os.sched_getaffinity(0)))):
            monkeypatch.delenv("LONGCTX_THREADS_FROM", raising=False)
            monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.3, v=idle: v)
            threads.fit_to_idle_cores()
            assert torch.get_num_threads() == min(expected, len(os.sched_getaffinity(0)))
            assert f"{idle:.1f} of" in threads.describe() and "cores idle at start" in threads.describe()
        monkeypatch.setenv("LONGCTX_THREADS_FROM", "--threads")
        torch.set_num_threads(1)
        threads.fit_to_idle_cores()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_idle_cores_reads_the_machine():
    from longctx import threads

    free = threads.idle_cores(0.05)
    assert free is None or 0.0 <= free <= len(os.sched_getaffinity(0)) + 1e-6
