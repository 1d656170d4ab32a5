"""`longctx eval` stopped part-way (eval/stopped.py) and its heatmap's cells without a figure (eval/plots.py).

A run that stops at one length (out of memory at the longest, Ctrl-C) lost every length it had finished: the
JSON was written only at the end. Now the finished lengths go to --output's name with .incomplete, marked
(what stopped it, the lengths done and not run), with the very figures a finished run gives them; --output
itself, an earlier result there included, is left as it was (and said before work that it would be replaced);
a later finished run removes the stale .incomplete file. And a heatmap cell with no figure read 'nan'.
"""

import json

import pytest
from test_eval_one_length_held import tiny_model_and_text

from longctx import cli
from longctx.eval import runner


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_and_text(tmp_path_factory.mktemp("stopped"))


def _eval(folder, task: str, *extra):
    hf, text = folder
    more = ["--depths", "0,1"] if task != "ppl" else []
    return cli.main(["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--data", str(text),
                     "--lengths", "256,512", "--samples", "2", *more, *extra])


def _stop_at(monkeypatch, call: int, error: BaseException):
    """runner.score raising `error` at its `call`-th call (1: the first length of the first task)."""
    plain, calls = runner.score, []

    def score(*a, **k):
        calls.append(1)
        if len(calls) == call:
            raise error
        return plain(*a, **k)
    monkeypatch.setattr(runner, "score", score)


def _cells(result: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in result["results"]]


def test_an_error_at_a_length_keeps_the_lengths_done(folder, tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    _stop_at(monkeypatch, 2, RuntimeError("CUDA out of memory (simulated)"))
    with pytest.raises(RuntimeError, match="out of memory"):
        _eval(folder, "ppl", "--output", str(out))
    assert not out.exists()  # (--output is a finished run's)
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert kept["incomplete"] == {"stopped_by": "RuntimeError: CUDA out of memory (simulated)",
                                  "lengths_done": [256], "lengths_not_run": [512]}
    assert [r["length"] for r in kept["results"]] == [256]
    monkeypatch.undo()
    assert _eval(folder, "ppl", "--output", str(out)) == 0
    full = json.loads(out.read_text())
    assert "incomplete" not in full and [r["length"] for r in full["results"]] == [256, 512]
    assert _cells(kept) == _cells(full)[:1]  # (the kept figures are a finished run's)
    assert not (tmp_path / "out.incomplete.json").exists()  # (the finished run removed the stale cells)


def test_ctrl_c_leaves_an_earlier_output_and_says_so(folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    out.write_text('{"earlier": true}\n')
    _stop_at(monkeypatch, 2, KeyboardInterrupt())
    assert _eval(folder, "passkey", "--output", str(out)) == 130  # (cli.py: "interrupted")
    said = capsys.readouterr().err
    assert f"--output {out} exists: it is replaced once the evaluation is done" in said  # (before work)
    assert "interrupted (Ctrl-C)" in said and "an earlier result there stays as it was" in said
    assert out.read_text() == '{"earlier": true}\n'
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert kept["incomplete"]["lengths_done"] == [256] and kept["incomplete"]["stopped_by"] == "interrupted (Ctrl-C)"
    rows = kept["results"]
    assert [(r["length"], r["depth"], r["samples"]) for r in rows] == [(256, 0.0, 2), (256, 1.0, 2)]
    assert kept["accuracy"] == sum(r["correct"] for r in rows) / 4  # (over the cells done, not over none)


def test_several_tasks_stopped_in_the_second_keep_the_first(folder, tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    _stop_at(monkeypatch, 3, RuntimeError("boom"))  # (ppl's two lengths, then passkey's first)
    with pytest.raises(RuntimeError):
        _eval(folder, "ppl,passkey", "--output", str(out))
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert kept["incomplete"] == {"stopped_by": "RuntimeError: boom", "tasks_not_run": ["passkey"]}
    assert list(kept["tasks"]) == ["ppl"] and "incomplete" not in kept["tasks"]["ppl"]  # (ppl finished)
    assert [r["length"] for r in kept["tasks"]["ppl"]["results"]] == [256, 512]


def test_stopped_before_any_length_keeps_nothing_and_says_so(folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    _stop_at(monkeypatch, 1, KeyboardInterrupt())
    assert _eval(folder, "ppl", "--output", str(out)) == 130
    assert "before any length was done: no result kept" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_stopped_without_output_prints_the_lengths_done(folder, monkeypatch, capsys):
    _stop_at(monkeypatch, 2, RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        _eval(folder, "ppl")
    printed = json.loads(capsys.readouterr().out)
    assert printed["incomplete"]["lengths_not_run"] == [512] and len(printed["results"]) == 1


def test_heatmap_cells_without_a_figure_read_dash_not_nan(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from longctx.eval.plots import write_plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    rows = [{"length": 1024, "depth": 0.0, "accuracy": 1.0}, {"length": 1024, "depth": 0.5, "accuracy": None},
            {"length": 1 << 20, "depth": 0.0, "accuracy": 0.0}]  # (1M at 0.5: not run)
    write_plot({"task": "passkey", "model": "m", "accuracy": 0.5, "results": rows}, tmp_path / "heat.png")
    texts = sorted(t.get_text() for t in figures[0].axes[0].texts)
    assert texts == ["-", "-", "0", "100"]
    assert (tmp_path / "heat.png").stat().st_size > 0
    assert not any("nan" in t for t in texts)


def test_an_output_that_fails_at_the_end_prints_the_result(tmp_path, monkeypatch, capsys):
    """--output written after the whole evaluation: a full disk then printed a traceback and lost every figure."""
    import argparse
    import errno

    from longctx.errors import DataError
    from longctx.eval import command, stopped

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(stopped, "write_text_durably", full)
    result = {"task": "ppl", "results": [{"length": 256, "loss": 5.5}]}
    with pytest.raises(DataError, match="No space left on device.*printed on stdout"):
        command._write(result, argparse.Namespace(output=str(tmp_path / "out.json")))
    assert json.loads(capsys.readouterr().out) == result


def test_generate_mode_stopped_keeps_the_lengths_done(folder, tmp_path, monkeypatch):
    from longctx.eval import generate_mode

    calls = []

    def answers(model, tokenizer, group, *a, **k):
        calls.append(1)
        if len(calls) == 5:  # (256's four prompts, one at a time, then 512's first)
            raise RuntimeError("boom")
        return ["The pass key is 12345."] * len(group)
    monkeypatch.setattr(generate_mode, "_generate_answers", answers)
    out = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        _eval(folder, "passkey", "--mode", "generate", "--output", str(out))
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert kept["incomplete"]["lengths_not_run"] == [512] and kept["mode"] == "generate"
    assert [len(r["generated"]) for r in kept["results"]] == [2, 2] and kept["accuracy"] == 0.0


def test_an_output_that_is_a_stream_is_written_where_it_is(tmp_path):
    """--output to a pipe (or /dev/stdout, which durable.check_output_path accepts as written where it is) was
    replaced by a regular file renamed over it (as root, /dev/stdout itself), the reader getting nothing, and
    its default plot went beside it (/dev/stdout.png)."""
    import argparse
    import os
    import threading

    from longctx.eval import command

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    args = argparse.Namespace(output=str(fifo), plot="")
    command._write({"task": "ppl", "results": []}, args)
    reader.join(timeout=10)
    assert got and json.loads(got[0]) == {"task": "ppl", "results": []}
    assert fifo.is_fifo()
    from longctx.eval.task_list import default_plot

    assert default_plot(args) == ""  # (no PNG beside a stream)
    assert default_plot(argparse.Namespace(output=str(tmp_path / "r.json"), plot="")) == str(tmp_path / "r.png")
