"""What a run sets up before its first step: the eval-split rule and the cached CPU peak."""

import json
import re
from pathlib import Path

import pytest
import torch

from longctx.config import load_config
from longctx.costs import peaks
from longctx.train.metrics import read_jsonl
from longctx.train.setup import eval_split_problem


def _manifest(eval_samples: int) -> dict:
    return {"totals": {"eval_samples": eval_samples}}


@pytest.mark.parametrize("eval_samples", [0, 3])
def test_an_eval_split_smaller_than_a_global_batch_turns_evaluation_off_with_a_message(eval_samples):
    cfg = load_config(overrides=["--train.global_batch=4", "--train.grad_accum=4", "--train.eval_interval=10",
                                 "--data.path=s"])
    msg = eval_split_problem(cfg, "s", _manifest(eval_samples))
    assert msg is not None and f"has {eval_samples} samples, fewer than one global batch of 4" in msg
    assert "--eval-fraction" in msg and "train.eval_interval=0" in msg


def test_an_eval_split_that_fits_or_no_evaluation_says_nothing():
    cfg = load_config(overrides=["--train.global_batch=4", "--train.grad_accum=2", "--train.eval_interval=10"])
    assert eval_split_problem(cfg, "s", _manifest(4)) is None  # one global batch
    off = load_config(overrides=["--train.global_batch=4", "--train.eval_interval=0"])
    assert eval_split_problem(off, "s", _manifest(0)) is None


def test_the_cpu_peak_is_calibrated_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    calls = []

    def fake(size, seconds, **_):
        calls.append(torch.get_num_threads())
        return 2e11

    monkeypatch.setattr(peaks, "measure_cpu_gemm_peak", fake)
    peak, path, measured = peaks.machine_cpu_peak()
    assert (peak, measured) == (2e11, True) and path.is_file()
    assert calls == [peaks.usable_cores()]  # measured with every core
    for _ in range(3):
        assert peaks.machine_cpu_peak()[:3:2] == (2e11, False)
    assert len(calls) == 1
    # another machine (here: another core count) is calibrated for itself
    monkeypatch.setattr(peaks, "usable_cores", lambda: 64)
    assert peaks.machine_cpu_peak()[2] is True and len(calls) == 2
    # ranks on one machine share its peak; the MFU line says when and how it was measured
    per_rank, source = peaks.device_peak(torch.device("cpu"), local_ranks=4)
    assert per_rank == 2e11 / 4 and "shared by 4 ranks" in source
    assert re.search(r"measured 20\d\d-\d\d-\d\d \d\d:\d\d UTC with 64 threads at load \d", source), source


def test_an_older_cache_of_bare_numbers_still_reads(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    key = peaks._cached_peaks()[1]
    (tmp_path / peaks.CPU_PEAK_FILE).write_text(json.dumps({key: 3e11}))
    assert peaks.machine_cpu_peak()[::2] == (3e11, False)
    assert peaks.cpu_peak_source() == "cached by an older longctx, when unknown"


def test_a_damaged_peak_cache_is_recalibrated(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    (tmp_path / peaks.CPU_PEAK_FILE).write_text("{not json")
    monkeypatch.setattr(peaks, "measure_cpu_gemm_peak", lambda size, seconds, **_: 1e11)
    assert peaks.machine_cpu_peak()[::2] == (1e11, True)


def test_a_peak_calibrated_while_busy_is_raised_by_what_a_run_achieves(monkeypatch, tmp_path):
    """A cached peak far below what the machine does (as when it was measured under load) would put
    MFU above 100%; the run raises it to what it achieved, in the cache too."""
    import json

    from longctx.train.trainer import train

    cache = tmp_path / "cache"
    monkeypatch.setenv("LONGCTX_CACHE", str(cache))
    monkeypatch.setattr(peaks, "measure_cpu_gemm_peak", lambda size, seconds, **_: 1e6)  # 1 MFLOP/s: "busy"
    peaks.machine_cpu_peak()
    monkeypatch.setenv("LONGCTX_CACHE", str(cache))
    cfg = load_config("configs/debug.toml", [f"--train.run_dir={tmp_path / 'run'}", "--train.steps=3",
                                             "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=50",
                                             "--train.eval_interval=0", "--metrics.plots=false",
                                             "--metrics.progress=false", "--metrics.log_interval=1"])
    said = []
    train(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(0 < r["mfu"] <= 1 for r in records), [r["mfu"] for r in records]
    assert any("above its cached CPU peak" in line for line in said)
    entry = max(json.loads((cache / peaks.CPU_PEAK_FILE).read_text()).values(), key=lambda e: e["flops"])
    assert entry["flops"] > 1e6 and entry["how"] == "raised"
    assert peaks.cpu_peak_source().startswith("raised to what a run reached")


def test_the_data_summary_counts_the_eval_split_it_announced(tmp_path):
    """An eval split too small to evaluate is said once and counted as it is (it once read '0 eval
    samples' right after the line that gave its real size)."""
    from longctx.data.store import read_manifest
    from longctx.train.setup import build_data

    cfg = load_config("configs/debug.toml", ["--train.seq_len=64", "--data.max_docs=40", "--train.global_batch=1024"])
    said = []
    _, evals = build_data(cfg, log=said.append)
    summary = [line for line in said if "eval samples" in line and "->" in line][0]
    path = summary.split()[1]
    n = read_manifest(path)["totals"]["eval_samples"]
    assert evals is None and 0 < n < 1024
    assert f"{n:,} eval samples (not evaluated)" in summary
    assert any(f"has {n} samples, fewer than one global batch of 1024" in line for line in said)
    # the documents each split's tokens come from (one the holdout cuts is in both), from docs.jsonl
    splits = [json.loads(x)["split"] for part in sorted(Path(path).glob("part-*"))
              for x in (part / "docs.jsonl").read_text().splitlines()]
    in_train, in_eval = (sum(s in (name, "both") for s in splits) for name in ("train", "eval"))
    assert f"{len(splits):,} documents (train tokens from {in_train:,}, eval from {in_eval:,};" in summary


def test_each_metrics_record_carries_its_interval_mean_loss(tmp_path):
    """loss_mean: the mean of every step's loss since the previous line (loss.png draws it), where
    `loss` is the logged step's alone (issue 53: the plot showed single steps)."""
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", [f"--train.run_dir={tmp_path / 'run'}", "--train.steps=7",
                                             "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=50",
                                             "--train.eval_interval=0", "--metrics.plots=false",
                                             "--metrics.progress=false", "--metrics.log_interval=3",
                                             "--checkpoint.final=false"])
    result = train(cfg, log=lambda *a, **k: None)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in records] == [1, 3, 6, 7]
    bounds = [(0, 1), (1, 3), (3, 6), (6, 7)]
    for r, (a, b) in zip(records, bounds):
        assert r["loss"] == pytest.approx(result.losses[b - 1])
        assert r["loss_mean"] == pytest.approx(sum(result.losses[a:b]) / (b - a)), r["step"]
        assert r["interval_steps"] == b - a


def test_the_first_line_after_a_mid_interval_resume_says_how_many_steps_its_means_cover(tmp_path):
    """Saved at step 4 with lines every 3 steps: the resumed run's line at step 6 covers steps 5 and 6 only,
    and says so (interval_steps 2); its loss_mean is theirs."""
    from longctx.config.resume import load_run_config
    from longctx.train.trainer import train

    args = [f"--train.run_dir={tmp_path / 'run'}", "--train.seq_len=64", "--train.global_batch=2",
            "--data.max_docs=50", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
            "--metrics.log_interval=3", "--checkpoint.interval=4", "--checkpoint.async=false"]
    train(load_config("configs/debug.toml", [*args, "--train.steps=4"]), log=lambda *a, **k: None)
    cfg, _ = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path / 'run'}",
                                    "--train.steps=7"], layout_given=False)
    result = train(cfg, log=lambda *a, **k: None)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "train"]
    # (the first run's last step, 4, has its line too)
    assert [(r["step"], r["interval_steps"]) for r in records] == [(1, 1), (3, 2), (4, 1), (6, 2), (7, 1)]
    assert records[3]["loss_mean"] == pytest.approx(sum(result.losses[:2]) / 2)
