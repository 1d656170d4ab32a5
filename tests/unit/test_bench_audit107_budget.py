"""`longctx bench memory --max-seq --budget inf` (or infGiB): an infinite budget, which no step can exceed,
so the CPU search would grow until the host killed a probe. parse_bytes read it as a float and failed in
int() with an OverflowError traceback; it is refused, as nan and a negative budget are, before any probe."""

import argparse

import pytest

from longctx.bench import memory as bench_memory
from longctx.bench.max_seq import parse_bytes
from longctx.errors import ConfigError


@pytest.mark.parametrize("text", ["inf", "infGiB", "-inf", "nan"])
def test_a_budget_that_is_no_number_of_bytes_is_refused(text):
    with pytest.raises(ValueError, match=f"cannot read '{text}' as a size"):
        parse_bytes(text)


def test_the_cli_refuses_an_infinite_budget_before_any_probe(monkeypatch):
    def no_search(*_a, **_kw):
        raise AssertionError("the search ran")

    monkeypatch.setattr(bench_memory, "longest_sequence_cpu", no_search)
    p = argparse.ArgumentParser()
    bench_memory.add_arguments(p)
    with pytest.raises(ConfigError, match="cannot read 'inf' as a size"):
        bench_memory._measure_all(p.parse_args(["--max-seq", "--device", "cpu", "--budget", "inf"]))


def test_finite_sizes_still_read():
    assert parse_bytes("6GiB") == 6 * 2**30 and parse_bytes("2.5GB") == 2_500_000_000 and parse_bytes("1e3") == 1000
