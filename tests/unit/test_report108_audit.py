"""`longctx report RUN` on real runs (tiny trainings, then the report), where it drew a wrong plot in silence:

- a log interval whose every step was skipped (train.on_nonfinite = skip) has no `loss_mean`, and that one record
  switched the whole loss plot from the interval means to the single logged steps' losses, with the skipped
  steps an unmarked gap;
- a rollback that a resume into another --checkpoint.dir abandoned was still shaded over the steps the resumed
  attempt trained anew, and one recorded in an earlier attempt's checkpoint.dir (named only by its
  config.before-stepN.toml) was not shaded at all;
- a metrics.file a second run appended to (or an older longctx's resume, which left the abandoned attempt's
  records in place) was plotted as a mix: each step's newest record, the second run's first steps joined to the
  first run's later ones (two runs are now told apart by their records' run_id: each its own curve);
- a mistyped directory, or the directory above the runs, was reported as a missing metrics.jsonl in it.
"""

import json
import os

import pytest

from longctx.cli import main
from longctx.config import load_config
from longctx.errors import UserError
from longctx.train.report import rolled_back_steps, write_plots
from longctx.train.trainer import train

ARGS = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2", "--checkpoint.keep=20"]


def _train(monkeypatch, *args: str, fault: str = "") -> None:
    monkeypatch.setenv("LONGCTX_FAULT", fault)
    train(load_config(None, [*ARGS, *args]), log=lambda *a, **k: None)


@pytest.fixture
def figures(monkeypatch):
    """Every figure write_plots saves, by file name."""
    from matplotlib.figure import Figure

    saved, original = {}, Figure.savefig

    def savefig(self, path, *a, **k):
        saved[os.path.basename(str(path))] = self
        return original(self, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _lines(figure) -> dict:
    return {line.get_label(): line for line in figure.axes[0].get_lines()}


def test_an_interval_whose_every_step_was_skipped_keeps_the_mean_curve_and_is_marked(tmp_path, monkeypatch, figures):
    run = tmp_path / "run"
    _train(monkeypatch, "--train.steps=12", "--metrics.log_interval=4", f"--train.run_dir={run}",
           fault="nonfinite@5,nonfinite@6,nonfinite@7,nonfinite@8")
    write_plots(run, say=lambda *a: None)
    lines = _lines(figures["loss.png"])
    mean = lines["train (mean over each log interval)"]  # (was: "train (the logged step's loss, every 4 steps)")
    assert list(mean.get_xdata()) == [1, 4, 8, 12]
    ys = list(mean.get_ydata())
    assert ys[2] != ys[2] and all(y == y for y in ys[:2] + ys[3:])  # (step 8's interval: no mean, a gap)
    (skipped,) = [line for label, line in lines.items() if "skipped" in label]
    assert list(skipped.get_xdata()) == [8] and "4 steps" in skipped.get_label()


def test_a_rollback_a_resume_into_another_checkpoint_dir_abandoned_is_not_shaded(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _train(monkeypatch, "--train.steps=8", "--train.on_nonfinite=rollback", f"--train.run_dir={run}",
           fault="nonfinite@6")
    assert rolled_back_steps(run) == [(5, 6)]
    # (steps 3-8 trained again from step 2, saved into another directory: 5 and 6 are no discarded updates now)
    _train(monkeypatch, "--train.steps=8", "--train.on_nonfinite=rollback", f"--train.run_dir={run}",
           f"--checkpoint.resume={run}/checkpoints/step-00000002", f"--checkpoint.dir={tmp_path / 'other'}")
    assert rolled_back_steps(run) == []


def test_a_rollback_in_an_earlier_attempts_checkpoint_dir_is_shaded(tmp_path, monkeypatch):
    run, second = tmp_path / "run", tmp_path / "second"
    first = run / "first"  # (a checkpoint.dir inside the run directory: a resume from it into another is allowed)
    _train(monkeypatch, "--train.steps=8", "--train.on_nonfinite=rollback", f"--train.run_dir={run}",
           f"--checkpoint.dir={first}", fault="nonfinite@6")
    # (continued from its last checkpoint, after the rollback: the window stays discarded in this run's history)
    _train(monkeypatch, "--train.steps=10", "--train.on_nonfinite=rollback", f"--train.run_dir={run}",
           f"--checkpoint.resume={first}/step-00000008", f"--checkpoint.dir={second}")
    assert (run / "config.before-step8.toml").is_file()
    assert rolled_back_steps(run) == [(5, 6)]


def test_a_metrics_file_a_second_run_appended_to_plots_that_run_and_says_so(tmp_path, monkeypatch, figures):
    shared = tmp_path / "m.jsonl"
    _train(monkeypatch, "--train.steps=6", "--metrics.log_interval=1", f"--train.run_dir={tmp_path / 'a'}",
           f"--metrics.file={shared}")
    _train(monkeypatch, "--train.steps=3", "--metrics.log_interval=1", f"--train.run_dir={tmp_path / 'b'}",
           f"--metrics.file={shared}")
    said = []
    write_plots(tmp_path / "b", say=said.append)
    # each run its own curve, labelled by its run_id (leftovers110: before the records named no run, and the second
    # run's read as a restart at step 1; earlier still, 1-6 plotted as one: this run's 1-3, the first run's 4-6)
    a, b = dict.fromkeys(json.loads(line)["run_id"] for line in shared.read_text().splitlines())
    lines = _lines(figures["throughput.png"])
    assert list(lines[f"run {b}"].get_xdata()) == [1, 2, 3] and list(lines[f"run {a}"].get_xdata()) == [*range(1, 7)]
    assert any(f"holds the records of 2 runs (run_id {a}, {b}): the plots are run {b}'s" in s for s in said), said


def test_an_older_resume_that_left_the_abandoned_records_plots_the_resumed_attempt(tmp_path, figures):
    run = tmp_path / "run"
    run.mkdir()
    rec = {"kind": "train", "tokens_per_s": 10.0, "memory_gib": 1.0}
    first = [{**rec, "step": s, "loss": 9.0} for s in range(1, 11)] + [{"kind": "eval", "step": 10, "loss": 9.0}]
    resumed = [{**rec, "step": s, "loss": 1.0} for s in range(5, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + resumed))
    said = []
    write_plots(run, say=said.append)
    (line,) = _lines(figures["loss.png"]).values()  # (no eval line: step 10's is the abandoned attempt's)
    assert list(line.get_xdata()) == list(range(1, 9)) and list(line.get_ydata()) == [9.0] * 4 + [1.0] * 4
    assert any("start again at step 5 after step 10" in s for s in said), said


def _error(*args) -> str:
    with pytest.raises(UserError) as e:
        write_plots(*args, say=lambda *a: None)
    return " ".join(str(e.value).split())


def test_a_mistyped_run_directory_is_named(tmp_path):
    assert f"there is no directory {tmp_path / 'rn'}" in _error(tmp_path / "rn")
    (tmp_path / "metrics.jsonl").write_text("")
    assert f"is a file; pass the run directory (the one holding it, {tmp_path}?)" in _error(tmp_path / "metrics.jsonl")


def test_the_directory_above_the_runs_names_them(tmp_path):
    for name in ("b", "a"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("")
    said = _error(tmp_path / "runs")
    assert f"{tmp_path / 'runs' / 'a'}, {tmp_path / 'runs' / 'b'}" in said, said


@pytest.mark.parametrize("text", ["", '{"kind": "train", "st\n', '{"kind": "eval", "step": 2, "loss": 1.0}\n'])
def test_a_metrics_file_without_training_records_says_what_writes_them(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    said = _error(tmp_path)
    assert f"{tmp_path / 'metrics.jsonl'} holds no training records" in said and "metrics.log_interval" in said, said


def test_the_report_writes_the_files_it_names(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _train(monkeypatch, "--train.steps=4", "--metrics.log_interval=2", f"--train.run_dir={run}",
           "--train.eval_interval=2", "--metrics.progress=true")
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    named = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert [os.path.basename(p) for p in named] == ["loss.png", "throughput.png"]
    assert all(os.path.getsize(p) > 0 for p in named)


def test_a_named_metrics_file_gone_is_said_as_such(tmp_path):
    (tmp_path / "config.toml").write_text(f'[metrics]\nfile = "{tmp_path / "gone.jsonl"}"\n')
    said = _error(tmp_path)
    assert f"it is the metrics.file {tmp_path / 'config.toml'} names" in said, said


def test_a_run_directory_the_plots_cannot_be_written_to_is_an_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    def refused(self, path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 1.0,
                                                        "memory_gib": 1.0}) + "\n")
    monkeypatch.setattr(Figure, "savefig", refused)
    assert main(["report", str(tmp_path)]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'loss.png'}: Permission denied" in err and "wrote" not in err, err


def test_the_done_line_names_a_metrics_file_outside_the_run_directory(tmp_path, monkeypatch):
    """It said "Its config and metrics are in RUN/" where --metrics.file had put them elsewhere."""
    run, metrics, said = tmp_path / "run", tmp_path / "logs" / "m.jsonl", []
    monkeypatch.setenv("LONGCTX_FAULT", "")
    train(load_config(None, [*ARGS, "--train.steps=2", f"--train.run_dir={run}", f"--metrics.file={metrics}"]),
          log=lambda *a, **k: said.append(" ".join(map(str, a))))
    done = next(line for line in said if line.startswith("done: "))
    assert f"Its config is in {run}/, its metrics in {metrics}; the last step's weights" in done, done
