"""The README's commands as a user runs them, where they once went silently wrong: a Hugging Face
model trains on its own tokenizer, a resume continues the run it resumes, and the messages say only
what is true. Runs whose test reads only what they write and say are in this process (longctx_here); the
rest, and every run whose stderr is read, are real subprocesses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_newcomer import longctx_here as _in_this_process

from longctx.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_tokenizer_follows_model import hf_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # CLI runs of a few steps each: ~90 s together on a 2-core CPU
ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--metrics.progress=false", "--metrics.plots=false", "--metrics.log_interval=1"]


def longctx(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "longctx", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def longctx_here(*args, cwd=None):
    """longctx(ARGS) in this process (test_newcomer.longctx_here), for runs whose test reads what they write
    and say, not how their process ends or what it warns (a warning here goes to pytest, not to stderr):
    a new interpreter's imports cost seconds a run."""
    return _in_this_process(*map(str, args), cwd=cwd)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "train"}


def test_an_hf_model_trains_on_its_own_tokenizer_and_exports_it(tmp_path):
    d = hf_model_dir(tmp_path / "hf")
    tokenizer = str((d / "tokenizer.json").resolve())
    run = tmp_path / "run"
    r = longctx("train", "--nproc", 1, f"--model.init_from=hf:{d}", "--train.steps=2", "--train.seq_len=128",
                "--data.max_docs=40", "--train.eval_interval=0", "--checkpoint.interval=2", f"--train.run_dir={run}",
                *QUIET)
    assert r.returncode == 0, r.stderr
    assert f"({tokenizer} tokenizer" in r.stdout  # the data line names the tokenizer the store was built with
    # loading an HF model with nothing changed lists no changes; PyTorch's single-process DCP warning is gone
    assert "changed for this run" not in r.stdout
    assert "assuming the intent" not in r.stderr
    assert load_config(run / "config.toml").data.tokenizer == tokenizer
    step = run / "checkpoints" / "step-00000002"
    assert json.loads((step / "manifest.json").read_text())["tokenizer"] == tokenizer
    out = tmp_path / "export"
    r = longctx("checkpoint", "export", run / "checkpoints", out)
    assert r.returncode == 0, r.stderr
    assert "tokenizer files: tokenizer.json" in r.stdout and (out / "tokenizer.json").is_file()

    # an extension key is the one change said
    r = longctx("train", "--nproc", 1, f"--model.init_from=hf:{d}", "--model.rope_theta=20000", "--train.steps=1",
                "--train.seq_len=128", "--data.max_docs=40", "--train.eval_interval=0",
                f"--train.run_dir={tmp_path / 'ext'}", *QUIET)
    assert r.returncode == 0, r.stderr
    changed = [line for line in r.stdout.splitlines() if "changed for this run" in line]
    assert len(changed) == 1 and changed[0].endswith("changed for this run: model.rope_theta: 10000.0 -> 20000.0")


def test_a_byte_run_exports_saying_why_there_are_no_tokenizer_files(tmp_path):
    run = tmp_path / "run"
    r = longctx_here("train", "--nproc", 1, "--train.steps=1", "--train.seq_len=64", "--data.max_docs=40",
                     "--model.layers=1", "--train.eval_interval=0", "--checkpoint.interval=1",
                     f"--train.run_dir={run}", *QUIET)
    assert r.returncode == 0, r.stderr
    r = longctx_here("checkpoint", "export", run / "checkpoints", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "next to model.init_from" not in r.stdout and "byte tokenizer" in r.stdout


def test_resume_continues_the_run_with_its_saved_settings(tmp_path):
    """20 steps saved every 10, resumed with only --train.steps 30: step 30 is saved, the one changed
    key is said, and steps 21-30 train as an uninterrupted 30-step run does (a flat learning rate
    after warmup, so the two runs' schedules are the same: a decaying schedule is stretched by a
    longer train.steps, by definition)."""
    base = ["--train.seq_len=64", "--data.max_docs=60", "--model.layers=2", "--train.eval_interval=0",
            "--train.min_lr_ratio=1.0", "--train.warmup_steps=5", *QUIET]
    a, b = tmp_path / "a", tmp_path / "b"
    r = longctx_here("train", "--nproc", 1, *base, "--train.steps=20", "--checkpoint.interval=10",
                     f"--train.run_dir={a}")
    assert r.returncode == 0, r.stderr
    r = longctx_here("train", f"--train.run_dir={a}", "--checkpoint.resume=auto", "--train.steps=30")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("resume:")]
    assert len(said) == 1 and said[0].endswith("train.steps 20 -> 30"), said
    assert (a / "checkpoints" / "step-00000030" / "manifest.json").is_file()
    r = longctx_here("train", "--nproc", 1, *base, "--train.steps=30", f"--train.run_dir={b}")
    assert r.returncode == 0, r.stderr
    resumed, straight = _losses(a), _losses(b)
    assert sorted(resumed) == list(range(1, 31))
    diff = max(abs(resumed[s] - straight[s]) for s in range(21, 31))
    assert diff <= 1e-5, f"max |resumed - uninterrupted| over steps 21-30 = {diff:.2e}"

    # turning saving off (or changing the model or data) on a resume is refused, with the flag to use
    r = longctx("train", f"--train.run_dir={a}", "--checkpoint.resume=auto", "--train.steps=40",
                "--checkpoint.interval=0", "--checkpoint.final=false", "--model.rope_theta=1e6")
    assert r.returncode == 2
    flat = " ".join(r.stderr.split())
    assert "checkpoint.interval 10 -> 0" in flat and "model.rope_theta 10000.0 -> 1000000.0" in flat
    assert "checkpoint.final true -> false" in flat
    assert "--checkpoint.allow_changes true" in flat
