"""`bench memory --max-seq --seq-len 8192`: the per-length table asked for is measured beside the search. The
search drops the per-length tables only when --seq-len is left out (docs/benchmarks.md: `--max-seq --seq-len=`);
it told a left-out --seq-len from one given by its value, so 8192 (the default's value) given explicitly was
dropped from the JSON unsaid, while any other length given beside --max-seq was measured."""

import pytest

from longctx.bench import memory as bench_memory
from longctx.bench.arg_checks import check_bench_args
from longctx.cli import build_parser
from longctx.errors import ConfigError


def parse(argv):
    return build_parser("bench").parse_args(["bench", "memory", *argv])


@pytest.fixture
def measured(monkeypatch):
    """The lengths the per-length tables measured (no model built, no probe run)."""
    seen = []
    monkeypatch.setattr(bench_memory, "measure", lambda args, seq, *a: seen.append(seq) or {"seq_len": seq})
    monkeypatch.setattr(bench_memory, "longest_sequence_cpu", lambda args, name, budget: {"longest_seq_len": 0})
    monkeypatch.setattr(bench_memory.torch.cuda, "is_available", lambda: False)
    return seen


SEARCH = ["--max-seq", "--budget", "1GiB", "--device", "cpu", "--policies", "none"]


@pytest.mark.parametrize("given", ["8192", "4096", "4096,8192"])
def test_a_seq_len_given_beside_max_seq_is_measured(measured, given):
    doc = bench_memory._measure_all(parse([*SEARCH, "--seq-len", given]))
    want = [int(x) for x in given.split(",")]
    assert measured == want
    assert [r["seq_len"] for r in doc["results"]] == want
    assert "longest_sequence" in doc


def test_max_seq_alone_measures_no_table(measured):
    doc = bench_memory._measure_all(parse(SEARCH))
    assert measured == [] and doc["results"] == []


def test_the_tables_alone_default_to_8192(measured):
    doc = bench_memory._measure_all(parse(["--device", "cpu", "--policies", "none"]))
    assert measured == [8192] and [r["seq_len"] for r in doc["results"]] == [8192]


def test_the_default_length_is_still_checked_against_the_layout_before_work():
    """head 1 x ctx 3 cuts a length into 2 x 3 pieces: the default 8192 does not split, refused up front."""
    with pytest.raises(ConfigError, match="--seq-len 8192"):
        check_bench_args("memory", parse(["--ctx", "3"]))
