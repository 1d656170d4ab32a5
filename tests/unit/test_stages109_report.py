"""A staged run's metrics and plots say which stage each record is of (audit stages109).

Records carried seq_len alone (two stages of one length, a batch ramp-up, look alike), eval records not even
that, so the eval losses of a 64- and a 128-token eval set were drawn as one line; loss.png and throughput.png
showed nothing where a stage began, though loss and tokens/s move with the length trained."""

import json

from longctx.config import load_config
from longctx.train import report
from longctx.train.trainer import Trainer

ARGS = ["--data.max_docs=40", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--metrics.log_interval=2",
        "--train.eval_interval=2", "--train.eval_batches=1", "--train.warmup_steps=1", "--train.global_batch=2",
        "--train.stages=64:3,128:3", "--metrics.plots=false"]


def test_records_and_plots_mark_the_stages(tmp_path, monkeypatch):
    Trainer(load_config(None, [*ARGS, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: (r["stage"], r["seq_len"]) for r in records if r["kind"] == "train"}
    evals = {r["step"]: (r["stage"], r["seq_len"]) for r in records if r["kind"] == "eval"}
    assert train == {1: (1, 64), 2: (1, 64), 4: (2, 128), 6: (2, 128)}
    assert evals == {2: (1, 64), 4: (2, 128), 6: (2, 128)}
    assert report.run_stage_starts(tmp_path, 6) == [(2, 4, 128)]
    assert report.run_stage_starts(tmp_path, 3) == []  # (a run stopped before stage 2 marks none)
    marked = []
    monkeypatch.setattr(report, "mark_stages", lambda ax, starts: marked.append(starts))
    report.write_plots(tmp_path, say=lambda *a: None)
    assert marked == [[(2, 4, 128)]] * 2  # loss.png and throughput.png


def test_a_run_of_one_stage_records_no_stage(tmp_path):
    args = [a for a in ARGS if not a.startswith("--train.stages")] + ["--train.steps=2", "--train.seq_len=64"]
    Trainer(load_config(None, [*args, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any("stage" in r for r in records) and report.run_stage_starts(tmp_path, 2) == []
