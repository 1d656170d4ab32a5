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
