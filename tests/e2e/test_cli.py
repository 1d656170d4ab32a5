"""The `longctx` command as a user runs it (subprocesses)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_newcomer import longctx_here  # (refusals: in this process)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--train.steps=6", "--train.seq_len=64", "--train.eval_interval=3", "--data.max_docs=80",
         "--data.eval_fraction=0.1", "--metrics.log_interval=2", "--model.layers=1"]


def longctx(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=300)


def test_train_writes_config_metrics_and_plots(tmp_path):
    r = longctx("train", "--config", str(ROOT / "configs/debug.toml"), *SMALL, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    files = {p.name for p in run_dirs[0].iterdir()}
    assert {"config.toml", "metrics.jsonl", "loss.png", "throughput.png"} <= files
    assert "run directory:" in r.stdout and "MFU" in r.stdout and "eval loss" in r.stdout
    rep = longctx("report", str(run_dirs[0]))
    assert rep.returncode == 0 and "loss.png" in rep.stdout


@pytest.mark.parametrize("args, needle", [
    (["--config", "configs/debug.toml", "--train.nonsense", "1"], "unknown config key 'train.nonsense'"),
    (["--model.heads", "7", "--model.kv_heads", "2"], "model.heads (7) must be divisible by model.kv_heads (2)"),
    (["--config", "configs/missing.toml"], "does not exist"),
    (["--data.corpus=/nonexistent"], "neither 'stdlib' nor an existing directory"),
])
def test_bad_input_exits_nonzero_with_one_paragraph(args, needle):
    r = longctx_here("train", *args)  # (refused before any work; test_train_writes_config_metrics_and_plots runs it)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in " ".join(r.stderr.split())
    assert "\n\n" not in r.stderr.strip()


def test_print_config_is_loadable_toml(tmp_path):
    r = longctx("train", "--print-config", "--model.preset=llama3-8b", "--train.seq_len=8192")
    assert r.returncode == 0, r.stderr
    p = tmp_path / "c.toml"
    p.write_text(r.stdout)
    again = longctx("train", "--config", str(p), "--print-config")
    assert again.stdout == r.stdout and "dim = 4096" in r.stdout


def test_report_on_missing_run_is_explained(tmp_path):
    r = longctx_here("report", str(tmp_path))  # (a refusal: the real `longctx report` runs above)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "metrics.jsonl does not exist" in " ".join(r.stderr.split())


def test_help_lists_config_keys():
    r = longctx("train", "--help")
    assert r.returncode == 0 and "--model.kv_heads" in r.stdout and "--train.grad_accum" in r.stdout
