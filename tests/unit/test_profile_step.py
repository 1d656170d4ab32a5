"""metrics.profile_step (train/profile_step.py): one step under torch.profiler writes a Chrome trace and a table of
where the step's time went, by op and by kind; the run is otherwise the same run."""

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.train.metrics import read_jsonl
from longctx.train.profile_step import kind_of, top_table
from longctx.train.trainer import train

BASE = ["--model.layers=1", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=40", "--train.seq_len=128", "--train.global_batch=2", "--train.steps=3",
        "--checkpoint.final=false", "--metrics.log_interval=1"]


def _losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def test_the_profiled_step_writes_its_trace_and_table_and_the_run_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    said = []
    train(load_config("configs/debug.toml", [*BASE, f"--train.run_dir={tmp_path / 'p'}", "--metrics.profile_step=2"]),
          log=lambda *a, **k: said.append(" ".join(map(str, a))))
    train(load_config("configs/debug.toml", [*BASE, f"--train.run_dir={tmp_path / 'q'}"]), log=lambda *a, **k: None)
    out = tmp_path / "p" / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["step2_rank0.json", "step2_top.json"]
    assert json.loads((out / "step2_rank0.json").read_text())["traceEvents"]  # a Chrome trace
    table = json.loads((out / "step2_top.json").read_text())
    assert table["step"] == 2 and table["time"] == "CPU (aten ops)"
    times = [r["self_s"] for r in table["top"]]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert table["by_kind"]["matmul"]["self_s"] > 0  # (the model's matmuls, named as such)
    assert sum(k["share"] for k in table["by_kind"].values()) == pytest.approx(1.0)
    assert any(line.startswith("profile: step 2,") for line in said)
    assert _losses(tmp_path / "p") == _losses(tmp_path / "q")  # the profiled run trains as the plain one
    assert not (tmp_path / "q" / "profile").exists()


def test_a_profile_step_outside_the_run_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config("configs/debug.toml", [*BASE, "--metrics.profile_step=4"])
    said = " ".join(str(e.value).split())  # (the message is wrapped)
    assert "metrics.profile_step must be 0 (no profile) or a step of the run (1..train.steps = 3), got 4" in said


def test_kernels_are_sorted_into_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kind_of("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kind_of("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert kind_of("Memcpy DtoH (Device -> Pinned)") == "copy"
    assert kind_of("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"


def test_on_a_gpu_the_table_counts_the_kernels_device_time_only():
    ev = lambda key, device, dev_us, cpu_us: SimpleNamespace(  # noqa: E731
        key=key, count=2, device_type=device, self_device_time_total=dev_us, self_cpu_time_total=cpu_us)
    events = [ev("aten::mm", DeviceType.CPU, 0, 900), ev("sm90_xmma_gemm_bf16", DeviceType.CUDA, 300, 0),
              ev("flash_fwd_kernel", DeviceType.CUDA, 100, 0)]
    table = top_table(events, on_device=True)
    assert [r["name"] for r in table["top"]] == ["sm90_xmma_gemm_bf16", "flash_fwd_kernel"]
    assert table["total_self_s"] == pytest.approx(400e-6) and table["by_kind"]["matmul"]["share"] == 0.75
    assert [r["name"] for r in top_table(events, on_device=False)["top"]] == ["aten::mm"]
