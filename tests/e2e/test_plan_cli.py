"""`longctx plan` as a user runs it: table, JSON, the written config, bad requests, old flags."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_newcomer import longctx_here  # (refusals and plans without a run: in this process)

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
    from longctx.job.checks import check_layout

    out = tmp_path / "plan.toml"
    r = longctx("plan", "--model", "llama3-8b", "--gpus", "64", "--gpus-per-node", "8", "--hardware", "h100",
                "--seq-len", "1M", "--global-batch", "128", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "layout" in r.stdout and "MFU" in r.stdout and "bottleneck" in r.stdout and "wrote" in r.stdout
    assert "micro-batch" in r.stdout and "grad_accum" in r.stdout and "global batch 128" in r.stdout
    cfg = load_config(out, [])
    check_layout(cfg, 64)
    assert cfg.train.seq_len == 1048576 and cfg.model.dim == 4096 and cfg.train.global_batch == 128
    j = longctx_here("plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "h100", "--seq-len", "1M",
                "--global-batch", "128", "--json", "--no-write")
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    assert doc["request"]["seq_len"] == 1048576 and doc["request"]["global_batch"] == 128
    assert doc["request"]["hardware"]["name"] == "h100"
    assert doc["plans"] and doc["plans"][0]["feasible"] and doc["written"] is None
    best = doc["plans"][0]
    assert best["layout"]["ctx"] == cfg.parallel.ctx and best["memory_gib"]["total"] < 80
    assert best["policy"]["recompute"] == cfg.memory.recompute and "checkpoint" not in best["policy"]
    dp = best["layout"]["dp_replicate"] * best["layout"]["dp_shard"]
    assert best["micro_batch"] * dp * best["grad_accum"] == best["global_batch"] == cfg.train.global_batch
    assert best["grad_accum"] == cfg.train.grad_accum


def test_cpu_plan_trains_unchanged(tmp_path):
    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_HW)
    out = tmp_path / "plan.toml"
    r = longctx_here("plan", "--model", "debug", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(hw),
                "--seq-len", "256", "--global-batch", "2", "--out", str(out), "--train.eval_interval=0",
                "--data.max_docs=60", "--metrics.plots=false", "--metrics.progress=false")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert 'device = "cpu"' in text and "seq_len = 256" in text
    t = longctx("train", "--config", str(out), "--nproc", "2", "--train.steps", "2",
                f"--train.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-3000:]
    assert "done: steps 1-2" in t.stdout


def test_cpu_plan_of_a_moe_model_trains_unchanged(tmp_path):
    """A Mixture-of-Experts preset is planned (model states of every expert, FLOPs of the active ones,
    its MoE blocks' activations) and the written plan trains on 2 CPU ranks as written."""
    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_HW)
    out = tmp_path / "plan.toml"
    r = longctx_here("plan", "--model", "debug-moe", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(hw),
                "--seq-len", "256", "--global-batch", "2", "--out", str(out), "--json", "--train.eval_interval=0",
                "--data.max_docs=60", "--metrics.plots=false", "--metrics.progress=false")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    best = doc["plans"][0]
    assert best["feasible"] and doc["written"] == str(out)
    text = out.read_text()
    assert 'device = "cpu"' in text and "seq_len = 256" in text and "moe.experts = 8" in text
    t = longctx("train", "--config", str(out), "--nproc", "2", "--train.steps", "2",
                f"--train.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-3000:]
    assert "done: steps 1-2" in t.stdout and "moe aux" in t.stdout


def test_store_gives_the_attention_work_of_its_documents(tmp_path):
    """`longctx plan --store DIR` measures doc_work on the store's samples and says so in the table
    and the JSON; without it the plan says it assumes one document per sequence; a store built at
    another sequence length is refused, naming both lengths."""
    store = tmp_path / "store"
    b = longctx("data", "build", "--input", "stdlib", "--strategy", "concat", "--seq-len", "256", "--out", str(store),
                "--no-progress", "--max-docs", "40", "--dedup", "none")
    assert b.returncode == 0, b.stderr
    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_HW)
    common = ["--model", "debug", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(hw), "--no-write"]
    args = [*common, "--seq-len", "256"]
    plain = longctx_here("plan", *args, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "doc_work 1.0 (no --store: one document per sequence assumed)" in plain.stdout
    table = longctx_here("plan", *args, "--store", str(store), cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert f"from --store {store}" in table.stdout
    j = longctx_here("plan", *args, "--store", str(store), "--json", cwd=tmp_path)
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    work = doc["request"]["doc_work"]
    assert 0 < work < 1 and str(store) in doc["request"]["doc_work_source"]
    assert all(p["doc_work"] == work for p in doc["plans"])
    assert f"doc_work {round(work, 3)!r} (from --store" in table.stdout
    base = json.loads(longctx_here("plan", *args, "--json", cwd=tmp_path).stdout)
    assert doc["plans"][0]["times_s"]["step"] < base["plans"][0]["times_s"]["step"]
    wrong = longctx_here("plan", *common, "--seq-len", "512", "--store", str(store), cwd=tmp_path)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    text = " ".join(wrong.stderr.split())
    assert "256 tokens" in text and "--seq-len is 512" in text


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama9", "--gpus", "8", "--seq-len", "1M"], "--model 'llama9' is neither a preset"),
    (["--model", "llama3-8b", "--gpus", "0", "--seq-len", "1M"], "--gpus must be at least 1"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "12345"], "must be divisible by 2 x head x ctx"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "lots"], "is not a token count"),
    (["--model", "llama3-8b", "--gpus", "8"], "needs --seq-len TOKENS"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", "--hardware", "nowhere/hw.toml"], "nowhere/hw.toml"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", "--recompute", "most"], "unknown recompute policy"),
    (["--model", "llama3-70b", "--gpus", "8", "--seq-len", "4M", "--hardware", "h100"], "GPUs make it feasible"),
    # 960K, not 1M: with documents the sparse attention backward's accumulators (~8 GiB per GPU at
    # 1M / 8) leave 1M on 8 x A800 without chunked blocks infeasible even with offload; states on the
    # device (a host tier frees enough of the GPU to fit without activation offload)
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "960K", "--hardware", "a800", "--offload", "none",
      "--block-chunk", "0", "--model-states", "device"], "activation offload"),
])
def test_bad_or_infeasible_requests_exit_with_one_paragraph(args, needle, tmp_path):
    r = longctx_here("plan", *args, "--no-write", cwd=tmp_path)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in " ".join(r.stderr.split())


@pytest.mark.parametrize("old, value", [
    ("--seq", "1M"),          # a prefix of --seq-len: must not be taken as its abbreviation
    ("--seq=1M", None),
    ("--batch", "8"),
    ("--checkpoint", "full"),
    ("--dev", "h100"),        # nor an abbreviation of --device's successor --hardware
])
def test_an_old_flag_is_an_unknown_argument_never_an_abbreviation(old, value, tmp_path):
    args = ["--model", "llama3-8b", "--gpus", "8", *([] if old.startswith("--seq") else ["--seq-len", "1M"])]
    r = longctx_here("plan", *args, old, *([value] if value else []), "--no-write", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr)
    assert "Traceback" not in r.stderr and not r.stdout
    assert f"unexpected argument '{old.split('=')[0]}" in r.stderr


def test_hardware_takes_a_preset_or_a_toml_file(tmp_path):
    args = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "128K", "--json", "--no-write", "--top", "1"]
    preset = longctx_here("plan", *args, "--hardware", "a800", cwd=tmp_path)
    assert preset.returncode == 0, preset.stderr
    hw = json.loads(preset.stdout)["request"]["hardware"]
    assert (hw["name"], hw["memory_gib"], hw["intra_gbps"]) == ("a800", 80, 200)
    (tmp_path / "big.toml").write_text('[hardware]\nbase = "a800"\nmemory_gib = 160\n')
    for spec in ("big.toml", str(tmp_path / "big.toml")):  # relative to the working directory, or absolute
        file = longctx_here("plan", *args, "--hardware", spec, cwd=tmp_path)
        assert file.returncode == 0, file.stderr
        hw = json.loads(file.stdout)["request"]["hardware"]
        assert (hw["name"], hw["memory_gib"], hw["intra_gbps"]) == ("a800", 160, 200)
    default = longctx_here("plan", *args, cwd=tmp_path)
    assert json.loads(default.stdout)["request"]["hardware"]["name"] == "h100"
