"""`longctx bench generate --compile both` (issue 52's CPU proxy for decoding without per-token
overhead): the debug model decodes eagerly and through the compiled static-shape step in one run;
the JSON has both rates, their ratio and whether the tokens are identical (timings are not asserted:
the figures live in docs/benchmarks.md)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_generate_compile_both_prints_both_rates_and_identical_tokens():
    r = subprocess.run([sys.executable, "-m", "longctx.cli", "bench", "generate", "--compile", "both", "--threads", "1",
                        "--prompt-len", "64", "--new-tokens", "12", "--repeats", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["identical"] is True and out["model"]["preset"] == "debug" and out["batch"] == 1
    for mode in ("eager", "compiled"):
        assert out[mode]["decode_tokens_per_s"] > 0 and len(out[mode]["runs"]) == 2
    assert out["decode_speedup"] == pytest.approx(out["compiled"]["decode_tokens_per_s"]
                                                  / out["eager"]["decode_tokens_per_s"])
    assert out["compiled_calls"] == 3 * 11  # the warm-up run and two timed ones, 11 steps after the prefill's token
    # nothing compiled after the warm-up run, no graph break (a CPU has no CUDA graphs to skip)
    assert out["graphs_compiled_in_timed_runs"] == 0 and out["graph_breaks"] == 0 and out["cudagraph_skips"] == 0
