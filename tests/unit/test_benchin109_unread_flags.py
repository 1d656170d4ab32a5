"""A `longctx bench` flag that the run asked for does not read is refused before any work (exit 2), not ignored:
`bench generate --device cuda` without --compile timed the transformers comparison on the CPU and printed its
figures with rc 0; `bench moe --cluster 2x2 --dim 64` ran the preset's width; `bench memory --doc-len 512`
(read by --max-seq's probes only) measured the tables with --docs documents; `bench attention
--no-causal-reference` without --docs measured the causal reference it names; `bench decode --prompts F --lengths
8K` decoded F's prompts at their own lengths. A flag at its default, and the
probe process's own flags, stay taken."""

import pytest

from longctx.bench.arg_checks import check_bench_args
from longctx.cli import build_parser, main
from longctx.errors import ConfigError


def _args(*argv):
    return build_parser("bench").parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, said", [
    (("generate", "--device", "cuda"), "--device cuda: read only with --compile"),
    (("generate", "--preset", "small-100m"), "--preset small-100m: read only with --compile"),
    (("generate", "--compile", "both", "--dim", "64", "--memory-lengths", ""),
     "--dim 64, --memory-lengths '': shape or extend the comparison against transformers"),
    (("moe", "--tokens", "64"), "--tokens 64: read only with --cluster"),
    (("moe", "--cluster", "2x2", "--model", "debug-moe", "--dim", "64", "--seq-len", "128"),
     "--dim 64, --seq-len 128: not read by --cluster"),
    (("moe", "--profile"), "--profile: profiles the layer's kernels on a GPU only"),
    (("memory", "--doc-len", "512"), "--doc-len 512: read only by --max-seq's search"),
    (("memory", "--budget", "1GiB", "--seq-len", "512"), "--budget 1GiB: read only by --max-seq"),
    (("memory", "--attention-offload", "--seq-len", "512"), "--attention-offload: keeps the attention core's chunks"),
    (("attention", "--no-causal-reference", "--seq-balance", "zigzag"),
     "--seq-balance zigzag, --no-causal-reference: read only with --docs"),
    (("decode", "--target", "t", "--draft", "d", "--cape-table", "0.5:2,1:0"),
     "--cape-table 0.5:2,1:0: read only with --cape"),
    (("decode", "--target", "t", "--draft", "d", "--prompts", "p.jsonl", "--lengths", "8K"),
     "--lengths 8K: choose prompts from a corpus, which --prompts replaces"),
])
def test_a_flag_the_run_does_not_read_is_refused(argv, said):
    with pytest.raises(ConfigError) as e:
        check_bench_args(argv[0], _args(*argv))
    assert said in str(e.value) and "drop" in str(e.value)


@pytest.mark.parametrize("argv", [
    ("generate", "--compile", "true", "--preset", "debug", "--device", "cpu", "--prompt-len", "64"),
    ("generate", "--dim", "64", "--heads", "2", "--kv-heads", "2", "--memory-lengths", "", "--sharded", "1x2"),
    ("generate", "--device", "cpu", "--preset", "debug"),  # (their defaults: no mistake)
    ("moe", "--dim", "64", "--seq-len", "128", "--memory-seq-len", "128", "--malloc", "glibc"),
    ("moe", "--cluster", "2x2", "--model", "debug-moe", "--tokens", "64", "--layers", "1", "--zipf", "0"),
    ("memory", "--max-seq", "--budget", "1GiB", "--doc-len", "512", "--max-seq-step", "1024"),
    ("memory", "--probe", "full:1024", "--doc-len", "512", "--layers", "1"),  # (a --max-seq probe's own flags)
    ("memory", "--attention-chunk", "1024", "--attention-offload", "--seq-len", "4096"),
    ("attention", "--docs", "256", "--seq-balance", "zigzag", "--no-causal-reference", "--no-storage-tracker"),
    ("decode", "--target", "t", "--draft", "d", "--cape", "both", "--cape-table", "0.5:2,1:0", "--lengths", "8K"),
    ("decode", "--target", "t", "--draft", "d", "--prompts", "p.jsonl", "--max-new-tokens", "8"),
])
def test_the_flags_each_run_reads_are_taken(argv):
    check_bench_args(argv[0], _args(*argv))


def test_the_cli_says_it_with_exit_code_2_before_any_work(capsys, monkeypatch):
    from longctx.bench import generate

    monkeypatch.setattr(generate, "_measure", lambda *a: pytest.fail("measured despite an unread flag"))
    assert main(["bench", "generate", "--device", "cuda", "--repeats", "1"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and "--device cuda: read only with --compile" in captured.err


def test_an_unknown_bench_flag_is_a_usage_error(capsys):
    """(argparse exits 2 for a flag it does not know; bench's parse_known_args leftovers said it with rc 1)"""
    assert main(["bench", "attention", "--seq", "256"]) == 2
    err = capsys.readouterr().err
    assert "unexpected arguments for longctx bench attention: --seq 256" in err and "--help" in err

