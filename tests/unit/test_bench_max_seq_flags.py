"""`bench memory --max-seq` searches with the flags the run names: the probe process got no --micro-batch
(each probe trained one sequence while the JSON said `micro_batch` 2), and the search runs one process
whatever --head / --ctx (the JSON's `layout` then named a split the longest length was never probed
under) or --no-backward (the probe trains a whole step) say: those are refused before any probe."""

import json
import subprocess

import pytest

from longctx.bench import max_seq, memory
from longctx.bench.arg_checks import check_bench_args
from longctx.cli import build_parser
from longctx.errors import ConfigError


def parse(argv):
    return build_parser("bench").parse_args(["bench", "memory", *argv])


def test_each_probe_trains_the_micro_batch_the_run_names(monkeypatch):
    args = parse(["--max-seq", "--budget", "1GiB", "--micro-batch", "2", "--layers", "1", "--max-seq-step", "64"])
    commands = []

    def over_budget(cmd, **kw):  # the first probe is over the budget: one probe, its command kept
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"seq_len": 64, "peak_rss_bytes": 2**40}),
                                           stderr="")

    monkeypatch.setattr(max_seq.subprocess, "run", over_budget)
    max_seq.longest_sequence_cpu(args, "full", 2**30)
    assert commands[0][1:5] == ["-m", "longctx", "bench", "memory"]
    probe = parse(commands[0][5:])  # the probe process's own flags, as its parser reads them
    seen = []
    real_batch = memory._batch
    monkeypatch.setattr(memory, "_batch", lambda *a, **k: seen.append(a[2]) or real_batch(*a, **k))
    out = memory._probe_step(probe, "full", 0.0, 64)
    assert "peak_rss_bytes" in out and seen == [2]  # the tokens of two sequences, as the JSON says


@pytest.mark.parametrize("flags, said", [(["--head", "2"], "--head 2 x --ctx 1"),
                                         (["--ctx", "2"], "--head 1 x --ctx 2"),
                                         (["--no-backward"], "--no-backward")])
def test_flags_the_search_does_not_read_are_refused(flags, said):
    args = parse(["--max-seq", "--budget", "1GiB", *flags])
    with pytest.raises(ConfigError, match=said) as e:
        check_bench_args("memory", args)
    assert "--max-seq" in str(e.value)


def test_the_search_alone_and_the_tables_with_a_split_are_still_taken():
    check_bench_args("memory", parse(["--max-seq", "--budget", "1GiB", "--micro-batch", "2"]))
    check_bench_args("memory", parse(["--head", "2", "--seq-len", "512", "--no-backward"]))
