"""`longctx bench memory`'s per-length table: a policy that runs out of memory (`none` at a long length on a GPU,
the usual reason to run the table) is that policy's answer, as --max-seq's probes take it, and the other
policies keep their figures (the OOM's traceback lost the whole table, nothing on stdout); --docs more than a
length's tokens (documents of no token, the JSON's "docs" not what was packed) and offloadA with an A that is
no number (float's own message) are refused before any work."""

import json

import pytest
import torch

from longctx.bench import memory
from longctx.bench.arg_checks import check_bench_args
from longctx.cli import build_parser, main
from longctx.errors import ConfigError

SMALL = ["bench", "memory", "--preset", "debug", "--layers", "1", "--seq-len", "64", "--policies", "none,full",
         "--time-steps", "1", "--device", "cpu"]


def _oom_for(monkeypatch, policy: str, error: Exception):
    real = memory._measure_policy

    def measure(model, model_cfg, name, *a, **k):
        if name == policy:
            raise error
        return real(model, model_cfg, name, *a, **k)

    monkeypatch.setattr(memory, "_measure_policy", measure)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 68719476736 bytes")])
def test_a_policy_out_of_memory_keeps_the_others_figures(monkeypatch, capsys, error):
    _oom_for(monkeypatch, "none", error)
    assert main(SMALL) == 0
    doc = json.loads(capsys.readouterr().out)
    policies = doc["results"][0]["policies"]
    said = policies["none"]["error"]
    assert policies["none"]["fits"] is False and said.split(":")[0] in ("GPU out of memory", memory.HOST_OOM), said
    assert policies["full"]["measured_total_device_bytes"] > 0 and policies["full"]["step_s"] > 0
    assert "step_time_ratio_to_none" not in policies["full"]  # (none was not timed: no ratio to it)
    assert doc["results"][0]["tokens_per_rank"] == 64 and doc["code"]["version"]


def test_another_error_is_still_an_error(monkeypatch):
    _oom_for(monkeypatch, "none", RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(SMALL)


def _args(*argv):
    return build_parser("bench").parse_args(["bench", "memory", *argv])


def test_more_documents_than_tokens_are_refused():
    with pytest.raises(ConfigError, match=r"--docs 200 documents do not fit in --seq-len 64: .* give --docs 64"):
        check_bench_args("memory", _args("--seq-len", "64,8192", "--docs", "200"))
    check_bench_args("memory", _args("--seq-len", "64", "--docs", "64"))


def test_an_offload_fraction_that_is_no_number_says_what_a_is():
    with pytest.raises(ConfigError, match=r"--policies offloadx: offloadA takes A, the fraction .* offload0.25"):
        check_bench_args("memory", _args("--seq-len", "64", "--policies", "full,offloadx"))


def test_bench_moe_on_a_gpu_keeps_the_lengths_that_fit(monkeypatch, capsys):
    """`bench moe --device cuda --seq-len 64,128`: the length past the card is its row's answer, the other row
    keeps its figures (the OOM's traceback lost every row). Run on the CPU (moe_gpu.main's own check path)."""
    import argparse

    from longctx.bench import moe as bench_moe
    from longctx.bench import moe_gpu

    real = moe_gpu._wall

    def wall(layer, x, *a, **k):
        if x.shape[1] == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(layer, x, *a, **k)

    monkeypatch.setattr(moe_gpu, "_wall", wall)
    p = argparse.ArgumentParser()
    bench_moe.add_arguments(p)
    args = p.parse_args(["--dim", "32", "--experts", "4", "--expert-dim", "16", "--seq-len", "64,128",
                         "--routing", "uniform", "--repeats", "1"])
    assert moe_gpu.main(args, device=torch.device("cpu")) == 0
    rows = json.loads(capsys.readouterr().out)["timing"]
    assert rows[0]["tokens"] == 64 and rows[0]["moe_kernel_s"] > 0
    assert rows[1] == {"routing": "uniform", "tokens": 128, "fits": False,
                       "error": "GPU out of memory: CUDA out of memory. Tried to allocate 8.00 GiB"}


def test_the_timing_out_of_memory_keeps_the_measured_bytes(monkeypatch, capsys):
    """The timing holds every timed policy's model at once: its OOM is said on each timed entry, the bytes stay."""
    def oom(*_a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(memory, "_time_interleaved", oom)
    assert main(SMALL) == 0
    policies = json.loads(capsys.readouterr().out)["results"][0]["policies"]
    for entry in policies.values():
        assert entry["measured_total_device_bytes"] > 0 and "step_s" not in entry
        assert entry["step_time_error"].startswith("GPU out of memory") and "held together" in entry["step_time_error"]


@pytest.mark.parametrize("argv, said", [
    (("--layers", "1"), "--policies offload0.5, offload1.0 would offload nothing: --skip-last 1 keeps the last 1 "
                        "blocks on the device, and 1 are built"),
    (("--layers", "2", "--skip-last", "2", "--policies", "full,fulloffload0.5"), "--policies fulloffload0.5"),
])
def test_offload_that_offloads_nothing_is_refused(argv, said):
    """(each measured as the policy without offload, under its own name: host 0 bytes, "offload1.0")"""
    with pytest.raises(ConfigError) as e:
        check_bench_args("memory", _args("--seq-len", "64", *argv))
    assert said in str(e.value)
    check_bench_args("memory", _args("--seq-len", "64", "--layers", "2"))
    check_bench_args("memory", _args("--seq-len", "64", "--layers", "1", "--policies", "none,full,selective"))
