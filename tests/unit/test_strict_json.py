"""Records for other tools are strict JSON (longctx/strict_json.py): a non-finite float is written as null,
never as Python's NaN / Infinity, which jq, JavaScript and most JSON readers refuse (one NaN loss made a
run's whole metrics.jsonl unreadable to them). The report still draws such a run, the step as a gap."""

import json
import math

import pytest

from longctx import strict_json
from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--train.steps=4", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.progress=false", "--train.device=cpu", "--metrics.log_interval=1"]


def _strict(line: str):
    """A reader without Python's extensions (NaN, Infinity, -Infinity), as jq or JavaScript read JSON."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    record = {"loss": math.nan, "ppl": math.inf, "rows": [1.5, -math.inf, (2, math.nan)], "n": 3, "s": "NaN",
              "nested": {"ok": 0.25, "bad": float("-inf")}}
    text = strict_json.dumps(record)
    assert _strict(text) == {"loss": None, "ppl": None, "rows": [1.5, None, [2, None]], "n": 3, "s": "NaN",
                             "nested": {"ok": 0.25, "bad": None}}
    with pytest.raises(ValueError):  # the reader above does refuse what json.dumps writes by default
        _strict(json.dumps(record))
    assert math.isnan(strict_json.number(None)) and strict_json.number(2) == 2.0


def test_a_non_finite_step_leaves_metrics_every_reader_can_parse_and_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}", "--metrics.plots=true"])
    result = Trainer(cfg, log=lambda *a, **k: None).run()
    assert math.isnan(result.losses[2])  # the step did go non-finite
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r.get("kind", "train") == "train"}
    assert train[3]["loss"] is None and train[3]["skipped_steps"] == 1
    assert all(isinstance(train[s]["loss"], float) for s in (1, 2, 4))
    assert (tmp_path / "loss.png").stat().st_size > 0  # the report drew the run, step 3 a gap
