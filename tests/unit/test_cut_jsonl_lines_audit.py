"""A JSONL line cut short (a run killed, or out of disk, while it wrote a metrics line or a rollback record):
the resume crashed with a raw JSONDecodeError in continue_run_files (the run could not go on until the file
was edited by hand), `longctx report` crashed the same way, and a record appended after a cut line joined it
(a rollback record so lost: a resume replayed the skipped window)."""

import errno

import pytest

from longctx.config import load_config
from longctx.errors import TrainingError
from longctx.train.metrics import MetricsWriter, read_jsonl
from longctx.train.report import write_plots
from longctx.train.rollback import record_rollback, rollback_from
from longctx.train.setup import continue_run_files
from longctx.train.trainer import Trainer

BASE = ["--train.steps=4", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--metrics.log_interval=1"]
QUIET = dict(log=lambda *a, **k: None)


def _cut(metrics):
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last line cut mid-write
    return len(lines)


def test_a_resume_after_a_cut_metrics_line_moves_it_aside_and_logs_each_step_once(tmp_path):
    args = [*BASE, f"--train.run_dir={tmp_path}"]
    Trainer(load_config(None, args), **QUIET).run()
    metrics = tmp_path / "metrics.jsonl"
    _cut(metrics)  # step 4's line
    resumed = Trainer(load_config(None, [*args, "--train.steps=6", "--checkpoint.resume=auto"]), **QUIET)
    assert resumed.start_step == 4
    resumed.run()
    assert [r["step"] for r in read_jsonl(metrics) if r.get("kind", "train") == "train"] == [1, 2, 3, 5, 6]
    assert len(metrics.read_text().splitlines()) == len(read_jsonl(metrics))  # no line joined to the cut one
    assert metrics.with_name("metrics.after-step4.jsonl").read_text().endswith("\n")  # kept, not lost


def test_a_complete_last_line_without_its_newline_is_not_joined_by_the_next(tmp_path):
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}"])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}')
    continue_run_files(tmp_path, cfg, 2, lambda *a: None, metrics)
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_report_leaves_a_cut_line_out_and_says_so(tmp_path):
    Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), **QUIET).run()
    n = _cut(tmp_path / "metrics.jsonl")
    said = []
    assert [p.name for p in write_plots(tmp_path, say=said.append)] == ["loss.png", "throughput.png"]
    assert said and f"line {n} is no JSON record" in said[0]


def test_a_rollback_recorded_after_a_cut_line_is_found(tmp_path):
    record_rollback(tmp_path, 6, 4, "nan", {"cursor": 6}, "abc")
    path = tmp_path / "rollbacks.jsonl"
    path.write_text(path.read_text()[:30])  # the record cut by a crash while it was written
    record_rollback(tmp_path, 9, 8, "nan", {"cursor": 9}, "def")
    assert rollback_from(tmp_path, 8, "def")["bad_step"] == 9
    assert len(read_jsonl(path)) == 1


def test_a_metrics_line_on_a_full_disk_stops_the_run_saying_so(tmp_path):
    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer._file.close()
    writer._file = FullDisk()
    with pytest.raises(TrainingError, match="step 7 could not be written .*No space left.*--checkpoint.resume auto"):
        writer.write({"step": 7, "loss": 1.0})
