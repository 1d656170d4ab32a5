"""`bench memory --max-seq`: a probe that fails for another reason than memory (a traceback, a signal other than
the OOM killer's) is no answer to the search. It was read as "does not fit", and the search reported the length
under the failure as the longest that fits (a bug at 16K read as a memory limit of 15K); its "error" was a list.
Now the policy's entry has no longest length and says which probe failed, and the other policies keep theirs."""

import argparse
import sys

from longctx.bench import max_seq, memory


def _args(*extra):
    p = argparse.ArgumentParser()
    memory.add_arguments(p)
    return p.parse_args(["--preset", "debug", "--layers", "1", "--max-seq-step", "1024", *extra])


def _probe_failing_from(length: int):
    def probe(args, name, seq, device, env=None):
        if seq >= length:
            return {"seq_len": seq, "fits": False, "failed": True, "error": "IndexError: index out of range"}
        return {"seq_len": seq, "peak_rss_bytes": seq, "step_s": 0.1} if device == "cpu" else \
            {"seq_len": seq, "fits": True, "peak_allocated_bytes": seq}
    return probe


def test_a_failed_probe_is_no_longest_length_on_cpu(monkeypatch):
    monkeypatch.setattr(max_seq, "_run_probe", _probe_failing_from(16384))
    found = max_seq.longest_sequence_cpu(_args(), "none", budget=1 << 40)
    assert found["longest_seq_len"] is None
    assert found["error"] == "the probe at 16,384 tokens failed: IndexError: index out of range"
    assert [p["seq_len"] for p in found["probes"]] == [1024, 2048, 4096, 8192, 16384]


def test_a_failed_probe_is_no_longest_length_on_a_gpu(monkeypatch):
    monkeypatch.setattr(max_seq, "_run_probe", _probe_failing_from(40960))
    found = max_seq.longest_sequence(_args("--max-seq-hi", "65536"), "none")
    assert found["longest_seq_len"] is None and "the probe at" in found["error"]


def test_a_probe_process_that_fails_is_marked_failed_with_its_last_line(monkeypatch):
    monkeypatch.setattr(max_seq, "_probe_command", lambda *a: [sys.executable, "-c", "raise IndexError('boom')"])
    out = max_seq._run_probe(_args(), "none", 4096, "cpu")
    assert out["failed"] is True and out["fits"] is False and out["error"] == "IndexError: boom"
    monkeypatch.setattr(max_seq, "_probe_command", lambda *a: [sys.executable, "-c", "raise MemoryError"])
    assert "failed" not in max_seq._run_probe(_args(), "none", 4096, "cpu")  # (memory: an answer)


def test_the_other_policies_keep_their_answers(monkeypatch, capsys):
    import json

    def probe(args, name, seq, device, env=None):
        if name == "none" and seq >= 4096:
            return {"seq_len": seq, "fits": False, "failed": True, "error": "killed by signal 11"}
        return {"seq_len": seq, "peak_rss_bytes": seq * 1000, "step_s": 0.1}

    monkeypatch.setattr(max_seq, "_run_probe", probe)
    from longctx.cli import main

    assert main(["bench", "memory", "--max-seq", "--budget", "10MB", "--policies", "none,full", "--device", "cpu",
                 "--layers", "1", "--max-seq-step", "1024"]) == 0
    per_policy = json.loads(capsys.readouterr().out)["longest_sequence"]["per_policy"]
    assert per_policy["none"]["longest_seq_len"] is None and "signal 11" in per_policy["none"]["error"]
    assert per_policy["full"]["longest_seq_len"] == 9216  # (10 MB / 1000 bytes a token, in steps of 1024)


def test_a_gpu_allocation_failure_outside_torchs_oom_error_is_still_an_answer(monkeypatch):
    """(cuBLAS's workspace, a CUDA error string: memory all the same, not a failed probe)"""
    for text in ("RuntimeError: CUDA error: out of memory", "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling"):
        monkeypatch.setattr(max_seq, "_probe_command", lambda *a, t=text: [
            sys.executable, "-c", f"import sys; sys.stderr.write({t!r}); sys.exit(1)"])
        out = max_seq._run_probe(_args(), "none", 4096, "cuda")
        assert "failed" not in out and out["fits"] is False and out["error"].startswith("GPU out of memory")
