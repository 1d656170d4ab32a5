"""`bench generate --compile both` times eager and compiled decoding in turn; the compiled step had an
untimed first run (its compilation) and eager decoding had none, so eager's first timed run carried the
first-call costs (on a GPU: lazy kernel loading, new GEMM shapes' heuristics, the allocator's growth) and
`decode_speedup` (best or median of a few) leaned toward the compiled step. Each mode now has an untimed
first run of its own."""

import argparse

from longctx.bench import generate as bench_generate


def test_every_mode_has_an_untimed_first_run(monkeypatch):
    p = argparse.ArgumentParser()
    bench_generate.add_arguments(p)
    args = p.parse_args(["--compile", "both", "--repeats", "2", "--prompt-len", "8", "--new-tokens", "3"])
    calls = []

    def fake(model, prompt, new_tokens, chunk, compile):
        calls.append("eager" if compile is False else "compiled")
        return {"tokens": [1, 2, 3], "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}

    monkeypatch.setattr(bench_generate, "_time_decode", fake)
    result = bench_generate.measure_compile(args)
    timed = {name: len(result[name]["runs"]) for name in ("eager", "compiled")}
    assert timed == {"eager": 2, "compiled": 2}
    for name in ("eager", "compiled"):  # more runs than timed ones: the first, untimed, before the timed ones
        assert calls.count(name) == timed[name] + 1
        first_timed = len(calls) - 2 * args.repeats
        assert name in calls[:first_timed], (name, calls)
