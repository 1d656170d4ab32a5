"""Four defects earlier sessions noted and left (helper task leftovers110), each with a test that failed before:

- `longctx generate --output PIPE` (a named pipe) whose reader closes early: one line, exit code 141, as `| head` on
  stdout (the traceback the note named no longer happened: output.py writes a pipe in place and stops on
  BrokenPipeError); its hint said "Pass --output FILE", to a user who had passed --output: it now says a regular
  file.
- train.skip_limit's error named the steps of the streak as `last - count + 1`-`last`: after a resume from a
  checkpoint that an earlier attempt rolled back to, the run skips the rolled-back window, and that range named
  steps never run instead of the ones skipped. The streak's first step is now recorded (and saved with it).
- a rollback to a checkpoint after the last metrics line: the steps between (trained, and kept) were in no line's
  loss_mean; they now get a line of the checkpoint's step, written at the rollback.
- two runs given one metrics.file: no field told their records apart, so `longctx report` drew their steps as one
  curve; every record now carries run_id (kept by a resume) and run_attempt, and the report draws each run apart.
"""

import json
import os

import pytest

from longctx.config import load_config
from longctx.errors import TrainingError
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

ARGS = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--metrics.log_interval=1"]


def _faults(monkeypatch, kind, steps) -> None:
    monkeypatch.setenv("LONGCTX_FAULT", ",".join(f"{kind}@{s}" for s in steps))


def _trainer(tmp_path, *extra: str, log=None) -> Trainer:
    return Trainer(load_config(None, [*ARGS, *extra, f"--train.run_dir={tmp_path}"]),
                   log=log or (lambda *a, **k: None))


def test_skip_limit_names_the_steps_skipped_across_a_rolled_back_window(tmp_path, monkeypatch):
    # attempt 1 (skip): steps 1-2 bad and skipped, step 2 saved with a streak of 2, a crash in step 3
    _faults(monkeypatch, "nonfinite", [1, 2])
    first = _trainer(tmp_path, "--train.skip_limit=3", "--checkpoint.interval=2")
    run_until_crash(first, 3)
    # attempt 2 (rollback): resumed from step 2, step 4 bad: back to step 2, steps 3-4's data skipped; a crash
    # in step 5, before any newer save
    _faults(monkeypatch, "nonfinite", [4])
    second = _trainer(tmp_path, "--train.on_nonfinite=rollback", "--checkpoint.interval=2",
                      "--checkpoint.resume=auto")
    run_until_crash(second, 5)
    assert second.rollbacks == 1
    # attempt 3 (skip): resumed from step 2 again, it goes on at step 5 (past the window); step 5 bad ends the
    # streak of 3: steps 1, 2 and 5, never "steps 3-5" (3 and 4 were not run by this trajectory)
    _faults(monkeypatch, "nonfinite", [5])
    third = _trainer(tmp_path, "--train.skip_limit=3", "--checkpoint.interval=2", "--checkpoint.resume=auto")
    assert third.start_step == 4 and third.skipped_in_a_row == 2
    with pytest.raises(TrainingError, match=r"steps 1-5 \(3 in a row") as stopped:
        third.run()
    assert "steps 3-5" not in str(stopped.value)


def _train_records(tmp_path) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def test_a_rollback_logs_the_kept_steps_no_line_covered_yet(tmp_path, monkeypatch):
    # log every 4 steps, save every 2: step 8 bad goes back to step 6; steps 5-6 were trained and kept (step 6's
    # checkpoint holds them) but no metrics line had covered them, and the rollback started a new interval
    _faults(monkeypatch, "nonfinite", [8])
    trainer = _trainer(tmp_path, "--train.steps=10", "--metrics.log_interval=4", "--checkpoint.interval=2",
                       "--train.on_nonfinite=rollback")
    result = trainer.run()
    assert trainer.rollbacks == 1
    records = _train_records(tmp_path)
    # every kept step in exactly one record's interval: 1, 2-4, 5-6 (logged at the checkpoint's step), 9-10
    assert [(r["step"], r["interval_steps"]) for r in records] == [(1, 1), (4, 3), (6, 2), (10, 2)]
    kept = records[2]
    assert kept["loss_mean"] == pytest.approx(sum(result.losses[4:6]) / 2)
    assert kept["loss"] == pytest.approx(result.losses[5]) and kept["tokens"] == 6 * 2 * 64


@pytest.fixture
def figures(monkeypatch):
    """Every figure write_plots saves, by file name."""
    import os

    from matplotlib.figure import Figure

    saved, original = {}, Figure.savefig

    def savefig(self, path, *a, **k):
        saved[os.path.basename(str(path))] = self
        return original(self, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _curves(figure) -> dict:
    return {line.get_label(): list(line.get_xdata()) for line in figure.axes[0].get_lines()}


def test_a_resume_keeps_the_run_id_and_counts_its_attempts(tmp_path, monkeypatch):
    _faults(monkeypatch, "nonfinite", [])
    run_until_crash(_trainer(tmp_path, "--checkpoint.interval=2", "--train.eval_interval=2"), 4)
    _trainer(tmp_path, "--checkpoint.interval=2", "--train.eval_interval=2", "--checkpoint.resume=auto").run()
    records = _train_records(tmp_path)
    ids = {r["run_id"] for r in records}
    assert len(ids) == 1 and len(ids.pop()) >= 8
    assert [(r["step"], r["run_attempt"]) for r in records] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    evals = [r for r in _all_records(tmp_path / "metrics.jsonl") if r.get("kind") == "eval"]
    assert evals and all(r["run_id"] == records[0]["run_id"] for r in evals)  # (eval records carry it too)


def test_a_run_forked_from_another_directorys_checkpoint_has_its_own_id(tmp_path, monkeypatch):
    _faults(monkeypatch, "nonfinite", [])
    _trainer(tmp_path / "a", "--train.steps=2", "--checkpoint.interval=2").run()
    step2 = tmp_path / "a" / "checkpoints" / "step-00000002"
    _trainer(tmp_path / "b", "--train.steps=4", f"--checkpoint.resume={step2}").run()
    parent, fork = _train_records(tmp_path / "a"), _train_records(tmp_path / "b")
    assert [r["step"] for r in fork] == [3, 4]
    assert fork[0]["run_id"] != parent[0]["run_id"]  # (was the parent's: one run to the report)


def _all_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_runs_interleaved_in_one_metrics_file_plot_as_two_labelled_curves(tmp_path, monkeypatch, figures):
    from longctx.train.report import write_plots

    _faults(monkeypatch, "nonfinite", [])
    shared = tmp_path / "m.jsonl"
    for name, steps in (("a", 6), ("b", 3)):
        _trainer(tmp_path / name, f"--train.steps={steps}", f"--metrics.file={shared}", "--train.eval_interval=2").run()
    records = _all_records(shared)
    ids = list(dict.fromkeys(r["run_id"] for r in records))
    assert len(ids) == 2
    # as two runs writing the file at once leave it: their lines interleaved
    first, second = ([r for r in records if r["run_id"] == i] for i in ids)
    mixed = [r for pair in zip(first, second + [None] * len(first)) for r in pair if r is not None]
    shared.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    said = []
    write_plots(tmp_path / "b", say=said.append)
    curves = _curves(figures["loss.png"])
    assert curves[f"run {ids[0]}"] == [1, 2, 3, 4, 5, 6], curves  # (was one curve: the records of both, mixed)
    assert [x for label, x in curves.items() if label.startswith("train")] == [[1, 2, 3]], curves
    throughput = _curves(figures["throughput.png"])
    assert throughput[f"run {ids[0]}"] == [1, 2, 3, 4, 5, 6] and [1, 2, 3] in throughput.values(), throughput
    assert any(f"2 runs (run_id {ids[0]}, {ids[1]})" in s for s in said), said
    assert not any("start again" in s for s in said), said


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_output_whose_reader_closes_ends_as_stdout_does(tmp_path):
    """`mkfifo F; longctx generate --output F & head -c 1 F`: one line on stderr and exit code 141, as `| head` on
    stdout, no traceback, and no file in F's place or beside it (a pipe is written in place: no F.partial). The
    hint names a regular file: "Pass --output FILE" alone read as if --output had not been given."""
    import subprocess
    import sys

    pytest.importorskip("transformers")  # (test_hf writes the model with it)
    import test_hf

    model, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama", vocab_size=300, initializer_range=0.1))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "hello " * (i + 1)}) + "\n" for i in range(6)))
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-m", "longctx", "generate", "--checkpoint", f"hf:{model}", "--tokenizer",
                            "byte", "--prompts", str(prompts), "--max-new-tokens", "4", "--batch", "1", "--output",
                            # (300 logprobs a token: 160 KB in all, more than the pipe holds, so the run cannot end
                            # 0 by writing every line before this reader closes, however late it is scheduled)
                            str(pipe), "--logprobs", "300"], stderr=subprocess.PIPE, env=env)
    reader = os.open(pipe, os.O_RDONLY)  # (the run opens it once the weights are read)
    assert os.read(reader, 1)
    os.close(reader)  # (a reader that has what it wanted: `head -c 1`)
    err = " ".join(run.stderr.read().decode().split())
    assert run.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert f"error: --output {pipe} was closed by its reader" in err, err
    assert "Pass --output FILE (a regular file, not a pipe) to keep every line" in err, err
    assert not any(p.name.startswith("pipe.") for p in tmp_path.iterdir()) and not pipe.is_file()
