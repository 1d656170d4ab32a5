"""`longctx plan` as a user runs it: table, JSON, the written config, bad requests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A CPU-sized "device" so the e2e plan needs no calibration run (the name starting with "cpu" makes
# the written config train on the CPU in fp32).
CPU_HW = """[hardware]
name = "cpu-test"
memory_gib = 4.0
peak_tflops = 0.1
intra_gbps = 0.5
inter_gbps = 0.5
host_link_gbps = 5.0
host_memory_gib = 0.0
gemm_efficiency = 1.0
attention_efficiency = 0.5
comm_overlap = 0.0
usable_host_fraction = 0.0
dtype_bytes = 4
"""


def longctx(*args, cwd=None, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def test_plan_8b_1m_prints_a_table_and_writes_a_loadable_config(tmp_path):
    from longctx.config import load_config
    from longctx.train import check_layout

    out = tmp_path / "plan.toml"
    r = longctx("plan", "--model", "llama3-8b", "--gpus", "64", "--gpus-per-node", "8", "--device", "h100",
                "--seq", "1M", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "layout" in r.stdout and "MFU" in r.stdout and "bottleneck" in r.stdout and "wrote" in r.stdout
    cfg = load_config(out, [])
    check_layout(cfg, 64)
    assert cfg.train.seq_len == 1048576 and cfg.model.dim == 4096
    j = longctx("plan", "--model", "llama3-8b", "--gpus", "64", "--device", "h100", "--seq", "1M", "--json",
                "--no-write")
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    assert doc["plans"] and doc["plans"][0]["feasible"] and doc["written"] is None
    best = doc["plans"][0]
    assert best["layout"]["ctx"] == cfg.parallel.ctx and best["memory_gib"]["total"] < 80


def test_cpu_plan_trains_unchanged(tmp_path):
    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_HW)
    out = tmp_path / "plan.toml"
    r = longctx("plan", "--model", "debug", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(hw),
                "--seq", "256", "--batch", "2", "--out", str(out), "--train.eval_interval=0",
                "--data.max_docs=60", "--metrics.plots=false", "--metrics.progress=false")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert 'device = "cpu"' in text and "seq_len = 256" in text
    t = longctx("train", "--config", str(out), "--nproc", "2", "--train.steps", "2",
                f"--train.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-3000:]
    assert "done: steps 1-2" in t.stdout


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama9", "--gpus", "8", "--seq", "1M"], "model.preset = 'llama9' is not one of"),
    (["--model", "llama3-8b", "--gpus", "0", "--seq", "1M"], "--gpus must be at least 1"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "12345"], "must be divisible by 2 x head x ctx"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "lots"], "is not a token count"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "1M", "--device", "tpu"], "unknown device 'tpu'"),
    (["--model", "llama3-70b", "--gpus", "8", "--seq", "4M", "--device", "h100"], "GPUs make it feasible"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "1M", "--device", "a800", "--offload", "none", "--block-chunk", "0"],
     "activation offload"),
])
def test_bad_or_infeasible_requests_exit_with_one_paragraph(args, needle, tmp_path):
    r = longctx("plan", *args, "--no-write", cwd=tmp_path)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in " ".join(r.stderr.split())
