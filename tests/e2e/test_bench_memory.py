"""`longctx bench memory` as a user runs it: JSON with measured == analytic bytes for every policy."""

import json
import os
import subprocess
import sys

import pytest
from test_newcomer import longctx_here  # (refusals: in this process)


@pytest.mark.parametrize("layout", [[], ["--head=2", "--ctx=2"]])
def test_bench_memory_reports_every_policy_within_5_percent(layout):
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "memory", "--seq-len=256", "--micro-batch=2",
                          "--docs=3", "--time-steps=1", *layout], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    (result,) = doc["results"]
    assert set(result["policies"]) == {"none", "full", "selective", "offload0.5", "offload1.0"}
    errors = result.get("max_relative_error_over_ranks") or {k: v["max_relative_error"]
                                                            for k, v in result["policies"].items()}
    for name, err in errors.items():
        assert err["device"] <= 0.05 and err["host"] <= 0.05 and err["total_device"] <= 0.05, (name, err)
    pol = result["policies"]
    # the policies really differ: none keeps the most, offload 1.0 the least on the device
    dev = {k: v["analytic_per_token"]["per_block_device"] for k, v in pol.items()}
    assert dev["none"] > dev["selective"] > dev["full"] > dev["offload1.0"] == dev["offload0.5"] == 0
    assert pol["offload1.0"]["measured_total_host_bytes"] > pol["offload0.5"]["measured_total_host_bytes"] > 0
    assert all(v["step_s"] > 0 for v in pol.values())


@pytest.mark.parametrize("layout", [[], ["--head=2", "--ctx=2"]])
def test_bench_memory_of_a_moe_model_matches_its_count(layout):
    """debug-moe (block 0 dense, blocks 1-2 MoE: router, permuted tokens, experts, un-permute): every
    policy's blocks measured against their own count, within the dense tolerance (exact here but for
    the document ids the first block gathers without a layout, as for dense)."""
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "memory", "--preset=debug-moe", "--seq-len=256",
                          "--micro-batch=2", "--docs=3", "--time-steps=1", *layout], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = json.loads(out.stdout)["results"]
    errors = result.get("max_relative_error_over_ranks") or {k: v["max_relative_error"]
                                                            for k, v in result["policies"].items()}
    assert set(errors) == {"none", "full", "selective", "offload0.5", "offload1.0"}
    for name, err in errors.items():
        assert err["device"] <= 0.05 and err["host"] <= 0.05 and err["total_device"] <= 0.05, (name, err)
    pol = result["policies"]
    blocks = pol["none"]["analytic_blocks_bytes_per_token"]
    assert [b.get("moe", False) for b in blocks] == [False, True, True]
    measured = pol["none"]["measured_blocks_bytes_per_token"]
    assert measured[2]["device"] == pytest.approx(blocks[2]["device"], rel=1e-9)
    dev = {k: v["analytic_per_token"]["per_block_device"] for k, v in pol.items()}
    # an offloaded MoE block keeps only its router's records on the device (8 E + 8 bytes per call)
    assert dev["none"] > dev["selective"] > dev["full"] > dev["offload0.5"] > dev["offload1.0"] > 0
    assert dev["offload0.5"] < dev["full"] / 100


@pytest.mark.parametrize("bench,old", [("memory", "--seq"), ("attention", "--seq"), ("train", "--seqs"),
                                       ("memory", "--batch")])
def test_an_old_bench_flag_is_refused_not_taken_as_an_abbreviation(bench, old):
    """argparse would accept --seq for --seq-len; the bench parsers take no abbreviations."""
    out = longctx_here("bench", bench, old, "256")
    assert out.returncode != 0 and f"unexpected arguments for longctx bench {bench}: {old} 256" in out.stderr, \
        out.stderr
    assert not out.stdout


def _probe_rss(seq):
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "memory", "--probe", f"full:{seq}", "--preset",
                          "debug", "--layers", "1", "--block-chunk", "1024", "--attention-chunk", "1024",
                          "--doc-len", "512"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def test_max_seq_on_cpu_finds_the_longest_length_under_the_budget():
    """--max-seq --budget on CPU: each probe is a fresh process; the answer fits the budget and the next
    length up does not (the search really measured both sides), with attention chunks as a setting.
    The budget is halfway between the peaks this machine measures at 12K and 16K tokens (RSS at this
    small scale varies from machine to machine, so no absolute figure is assumed): the answer is
    exactly 12K. The probes here are started from pytest's large process; their peak is their own
    (VmHWM), not the one Linux's ru_maxrss carries over an exec from their parent."""
    at_12k, at_16k = _probe_rss(12288), _probe_rss(16384)
    assert at_16k > at_12k, (at_12k, at_16k)
    budget = (at_12k + at_16k) // 2
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "memory", "--max-seq", "--budget", str(budget),
                          "--preset", "debug", "--layers", "1", "--policies", "full", "--block-chunk", "1024",
                          "--attention-chunk", "1024", "--doc-len", "512", "--max-seq-step", "4096"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout)["longest_sequence"]
    assert found["budget_bytes"] == budget
    res = found["per_policy"]["full"]
    best, probes = res["longest_seq_len"], {p["seq_len"]: p for p in res["probes"]}
    assert best == 12288, (best, budget, probes)
    assert probes[best]["fits"] and probes[best]["peak_rss_bytes"] <= budget
    assert not probes[best + 4096]["fits"] and probes[best + 4096]["peak_rss_bytes"] > budget


def test_max_seq_on_cpu_needs_a_readable_budget():
    for extra, message in (([], "needs --budget"), (["--budget", "6 parsecs"], "cannot read")):
        out = longctx_here("bench", "memory", "--max-seq", *extra)
        assert out.returncode != 0 and message in out.stderr, out.stderr[-500:]
