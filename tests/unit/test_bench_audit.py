"""Figures of `longctx bench ...` against hand counts: bench train's rates over its timed steps,
bench decode's decode-step tokens, and bench memory --max-seq's search settings refused up front."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from longctx.bench import memory as bench_memory
from longctx.bench import train as bench_train
from longctx.errors import ConfigError


def _fake_train(monkeypatch, records: list[dict]) -> None:
    """bench train's `longctx train` subprocess replaced by one that writes `records` as its metrics."""
    def run(cmd, **_kw):
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--train.run_dir="))
        (Path(run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(bench_train.subprocess, "run", run)


def _record(step: int, tokens: int, seconds: float, flops: float, peak: float) -> dict:
    return {"kind": "train", "step": step, "loss": 1.0, "tokens_per_s": tokens / seconds,
            "mfu": flops / seconds / peak, "memory_gib": 0.5}


def test_bench_train_rate_is_total_tokens_over_total_time_of_the_timed_steps(monkeypatch):
    """Steps of equal work taking 1 s and 1/3 s: 200 tokens in 4/3 s is 150 tokens/s, not the mean
    of the per-step rates (200); the warm-up step (step 1, any rate) stays out."""
    tokens, flops, peak = 100, 4e9, 1e10
    seconds = {1: 10.0, 2: 1.0, 3: 1 / 3}
    _fake_train(monkeypatch, [_record(s, tokens, t, flops, peak) for s, t in seconds.items()])
    row = bench_train.run_one("debug", 64, "single", 3, 1)
    timed_s = seconds[2] + seconds[3]
    assert row["steps_timed"] == 2
    assert row["tokens_per_s"] == pytest.approx(2 * tokens / timed_s)
    assert row["mfu"] == pytest.approx(2 * flops / timed_s / peak)


def test_bench_train_times_no_checkpoint_save(monkeypatch):
    """The run's last step is timed; with checkpoint.final (its default) that step also blocked on the final
    save, which halved its tokens/s on the debug model at 256 tokens (repro_3 of the bench audit)."""
    seen = []

    def run(cmd, **_kw):
        seen.append(cmd)
        return SimpleNamespace(returncode=1, stderr="stopped")

    monkeypatch.setattr(bench_train.subprocess, "run", run)
    bench_train.run_one("debug", 64, "single", 3, 1)
    assert "--checkpoint.final=false" in seen[0] and not any(a.startswith("--checkpoint.interval=") for a in seen[0])


def test_bench_train_with_only_the_warm_up_step_reports_no_figures(monkeypatch):
    """One step is the warm-up: its rate (lazy set-up, compilation) is not a timed figure."""
    _fake_train(monkeypatch, [_record(1, 100, 5.0, 1e9, 1e10)])
    row = bench_train.run_one("debug", 64, "single", 1, 1)
    assert "tokens_per_s" not in row and "warm-up" in row["error"]

    def no_run(*_a, **_kw):
        raise AssertionError("a run was started")

    monkeypatch.setattr(bench_train, "run_one", no_run)
    args = SimpleNamespace(presets="debug", seq_len="64", layouts="single", steps=1, global_batch=1)
    with pytest.raises(ConfigError, match="--steps 2 or more"):
        bench_train.main(args)


def _memory_args(*argv: str):
    p = argparse.ArgumentParser()
    bench_memory.add_arguments(p)
    return p.parse_args(["--max-seq", *argv])


@pytest.mark.parametrize("argv, message", [
    (("--device", "cpu", "--budget", "1GiB", "--max-seq-step", "0"), "--max-seq-step 0"),
    (("--device", "cpu", "--budget", "1GiB", "--max-seq-step=-4096"), "--max-seq-step -4096"),
    (("--device", "cpu", "--budget", "0"), "--budget 0"),
    (("--device", "cpu", "--budget=-1GiB"), "--budget -1GiB"),
])
def test_bench_memory_max_seq_cpu_search_settings_are_refused_before_any_probe(monkeypatch, argv, message):
    """A step of 0 tokens probed 0 tokens forever; a budget of no bytes reported 0 as if measured."""
    def no_search(*_a, **_kw):
        raise AssertionError("the search ran")

    monkeypatch.setattr(bench_memory, "longest_sequence_cpu", no_search)
    with pytest.raises(ConfigError, match=message):
        bench_memory._measure_all(_memory_args(*argv))


def test_bench_memory_max_seq_gpu_ceiling_below_the_first_length_is_refused(monkeypatch):
    """--max-seq-hi under the search's first length (4096) probed nothing and reported 0 tokens."""
    def no_search(*_a, **_kw):
        raise AssertionError("the search ran")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_memory, "longest_sequence", no_search)
    with pytest.raises(ConfigError, match="--max-seq-hi 2048"):
        bench_memory._measure_all(_memory_args("--max-seq-hi", "2048"))


def test_bench_decode_rates_count_the_tokens_decode_steps_made():
    """6 new tokens: the first comes from the prefill's logits (before the clock the rates divide by
    starts), so 5 came from decoding, as generate/results.py counts decode tokens/s."""
    from longctx.bench.decode import _figures, _time_prompt
    from longctx.config import ModelConfig
    from longctx.generate.sampling import Sampling
    from longctx.models.llama import build_model

    cfg = ModelConfig(dim=32, layers=1, heads=2, kv_heads=1, ffn_dim=64, vocab_size=64)
    target, draft = build_model(cfg, seed=0).eval(), build_model(cfg, seed=1).eval()
    args = SimpleNamespace(repeats=1, max_new_tokens=6, speculate=2, draft_window=0, cost=0.1, verify_cost=0.0,
                           confidence_stop=0.0)
    with torch.no_grad():
        timed = _time_prompt(args, target, draft, list(range(1, 9)), Sampling(temperature=0.0), [(None, False)])[0]
    figures = _figures(timed)
    assert figures["tokens_per_s"] * timed["spec_s"] == pytest.approx(6 - 1)
    assert figures["baseline_tokens_per_s"] * timed["plain_s"] == pytest.approx(6 - 1)


def _comm_args(**over):
    from longctx.bench import comm_cluster

    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    args = p.parse_args(["--cluster", "2x1"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("over, message", [({"timed": 0}, "--timed 0"),
                                           ({"co2_local_steps": 0}, "--co2-local-steps 0")])
def test_bench_comm_refuses_no_timed_steps(monkeypatch, over, message):
    """--timed 0 failed on an empty window (IndexError), --co2-local-steps 0 on a division by zero."""
    from longctx.bench import comm_cluster

    def no_run(*_a, **_kw):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(comm_cluster, "run_spawned", no_run)
    with pytest.raises(ConfigError, match=message):
        comm_cluster.main(_comm_args(**over))


def _no_work(*_a, **_kw):
    raise AssertionError("the benchmark ran")


def test_bench_attention_refuses_zero_repeats(monkeypatch):
    """0 repeats timed nothing: best-of times read inf and the ratios nan, printed as figures."""
    from longctx.bench import attention

    p = argparse.ArgumentParser()
    attention.add_arguments(p)
    monkeypatch.setattr(attention, "run_spawned", _no_work)
    monkeypatch.setattr(attention, "run_docs", _no_work)
    for argv in ((), ("--docs", "64")):
        with pytest.raises(ConfigError, match="--repeats 0"):
            attention.run(p.parse_args(["--repeats", "0", "--seq-len", "64", *argv]))


def _main_with_zero_repeats(monkeypatch, command: str, argv: tuple):
    """`longctx bench COMMAND --repeats 0 ARGV`, its work replaced by _no_work."""
    from longctx.bench import decode, generate, moe

    if command == "decode":
        monkeypatch.setattr(decode, "_models", _no_work)
        return decode.main(SimpleNamespace(repeats=0, threads=0, device="cpu", dtype="fp32"))
    module = {"moe": moe, "generate": generate}[command]
    for name in ("_measure_cpu", "_measure", "measure_compile"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _no_work)
    monkeypatch.setattr(moe.moe_cluster, "run_spawned", _no_work)
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.main(p.parse_args(["--repeats", "0", *argv]))


@pytest.mark.parametrize("command, argv", [("moe", ()), ("moe", ("--cluster", "2x1")), ("generate", ()),
                                           ("generate", ("--compile",)), ("decode", ())])
def test_bench_moe_generate_decode_refuse_zero_repeats(monkeypatch, command, argv):
    """0 repeats: an empty min()/max() (moe, generate: after the work), or None results (decode)."""
    with pytest.raises(ConfigError, match="--repeats 0"):
        _main_with_zero_repeats(monkeypatch, command, argv)


def test_attention_docs_counts_the_visible_pairs_of_the_mask_it_times():
    """bench attention --docs --no-causal timed full attention within each document but summarised the
    documents' causal triangles (and a fraction of plain causal attention's pairs)."""
    import torch

    from longctx.bench.attention_docs import _doc_summary

    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # documents of 3 and 5 tokens
    causal, full = _doc_summary(ids, True), _doc_summary(ids, False)
    assert causal["visible_pairs"] == 6 + 15 and causal["visible_fraction_of_causal"] == 21 / 36
    assert full["visible_pairs"] == 9 + 25 and full["visible_fraction_of_full"] == 34 / 64
