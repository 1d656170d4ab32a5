"""`longctx bench generate`'s comparison against transformers had no untimed first run (--compile's modes have
one: tests/unit/test_bench_generate_eager_warm.py): its first timed runs carried the first-call costs, longctx's
more than transformers' that ran after it; with --repeats 1 they were the figures."""

import argparse

import transformers

from longctx.bench import generate as bench_generate


def test_each_side_has_an_untimed_first_run(monkeypatch):
    p = argparse.ArgumentParser()
    bench_generate.add_arguments(p)
    args = p.parse_args(["--repeats", "2", "--prompt-len", "8", "--new-tokens", "3", "--dim", "32", "--heads", "2",
                         "--kv-heads", "2", "--ffn-dim", "32", "--vocab", "64", "--layers", "1",
                         "--memory-lengths", ""])
    calls = []
    rate = {"tokens": [1, 2, 3], "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0, "seconds": 1.0}
    monkeypatch.setattr(bench_generate, "_time_longctx", lambda *a: calls.append("longctx") or dict(rate))
    monkeypatch.setattr(bench_generate, "_time_transformers", lambda *a: calls.append("transformers") or dict(rate))
    result = bench_generate._measure(args, transformers)
    assert {k: len(v) for k, v in result["runs"].items()} == {"longctx": 2, "transformers": 2}
    assert calls == ["longctx", "transformers"] * 3  # (one untimed pair first)
