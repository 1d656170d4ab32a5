"""The first metrics line's interval (train/metrics.py): it starts when the loop starts. It once
started when the MetricsLogger was made, early in the Trainer's set-up, so step 1's tokens/s and
MFU counted the rest of the set-up (the data entered, the setup line's collective, the run's
description) as training time: at world 1 step 1's interval read 0.11 s for a 0.06 s step, and
2.2 s for a 0.04 s step when the Trainer was made 0.5 s before it ran."""

import time

import pytest

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer

SETUP_S = 0.5  # time spent between the Trainer's set-up and its loop


def test_step_one_throughput_counts_the_loop_not_the_set_up(tmp_path):
    cfg = load_config(overrides=[
        f"--train.run_dir={tmp_path}", "--train.steps=2", "--train.seq_len=64", "--train.global_batch=2",
        "--train.eval_interval=0", "--data.max_docs=40", "--metrics.log_interval=1", "--metrics.progress=false",
        "--metrics.plots=false", "--model.layers=1", "--train.device=cpu", "--checkpoint.final=false"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    time.sleep(SETUP_S)
    trainer.run()
    first, second = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    interval_s = first["tokens"] / first["tokens_per_s"]
    assert interval_s <= first["elapsed_s"] + SETUP_S / 2  # the loop's time since it began, not the set-up's
    assert first["mfu"] / first["tokens_per_s"] == pytest.approx(second["mfu"] / second["tokens_per_s"])


def test_an_evaluations_clock_starts_after_the_devices_queued_work(tmp_path, monkeypatch):
    """On CUDA the loop runs ahead of the device: an evaluation timed from the moment it is called takes
    in the tail of the training steps queued before it, and that time is taken out of training's (its
    tokens/s then read high). Its clock starts after a synchronize (the CUDA call is checked as
    documented: torch.cuda.synchronize(device) before the time is read)."""
    import torch

    from longctx.train.metrics import MetricsLogger

    logger = MetricsLogger.__new__(MetricsLogger)
    logger.device = torch.device("cuda", 0)
    calls = []

    def synchronize(device=None):
        calls.append(device)
        time.sleep(0.2)  # the queued work

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    before = time.perf_counter()
    assert logger.now() - before >= 0.2 and calls == [logger.device]
    logger.device = torch.device("cpu")
    before = time.perf_counter()  # (timed alone: the CUDA call's oversleep above is not this call's)
    assert logger.now() - before < 0.2 and len(calls) == 1  # (nothing queued on the CPU)

    # the trainer's evaluations start their clock there
    started = []
    real_now = MetricsLogger.now
    monkeypatch.setattr(MetricsLogger, "now", lambda self: started.append(1) or real_now(self))
    cfg = load_config(overrides=[
        f"--train.run_dir={tmp_path}", "--train.steps=2", "--train.seq_len=64", "--train.global_batch=2",
        "--train.eval_interval=1", "--train.eval_batches=1", "--data.max_docs=40", "--metrics.progress=false",
        "--metrics.plots=false", "--model.layers=1", "--train.device=cpu", "--checkpoint.final=false"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    assert len(evals) >= 2 and len(started) >= len(evals)
