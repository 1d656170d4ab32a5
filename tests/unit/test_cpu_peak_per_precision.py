"""On CPU, MFU's peak is the machine's GEMM peak in the precision the run computes in (costs/peaks.py): a
train.dtype = bf16 run (CPU autocast) was divided by the fp32 GEMM peak. On a CPU with AMX (this project's
machines: bf16 GEMMs 6.7x fp32's) such a run read 'MFU 100%' and raised the cached fp32 peak to its bf16
rate (0.39 -> 0.69 TFLOP/s measured), so every later fp32 run's MFU read 1.8x low, silently."""

import json

import torch

from longctx.costs import peaks

RATE = {torch.float32: 1e11, torch.bfloat16: 7e11}


def _fake_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    monkeypatch.setattr(peaks, "measure_cpu_gemm_peak",
                        lambda size=1024, seconds=0.3, dtype=torch.float32: RATE[dtype])


def test_a_bf16_run_is_divided_by_the_bf16_gemm_peak(monkeypatch, tmp_path):
    _fake_machine(monkeypatch, tmp_path)
    fp32, fp32_source = peaks.device_peak(torch.device("cpu"), dtype=torch.float32, local_ranks=2)
    bf16, bf16_source = peaks.device_peak(torch.device("cpu"), dtype=torch.bfloat16, local_ranks=2)
    assert (fp32, bf16) == (1e11 / 2, 7e11 / 2)
    assert "CPU fp32 GEMM peak" in fp32_source and "CPU bf16 GEMM peak" in bf16_source


def test_a_fast_bf16_run_raises_only_the_bf16_peak(monkeypatch, tmp_path):
    _fake_machine(monkeypatch, tmp_path)
    key32 = peaks._cached_peaks(torch.float32)[1]
    peaks.machine_cpu_peak(torch.float32)
    peaks.raise_cpu_peak(9e11, torch.bfloat16)
    assert peaks.machine_cpu_peak(torch.float32)[0] == 1e11  # the fp32 runs' MFU is left alone
    assert peaks.machine_cpu_peak(torch.bfloat16)[0] == 9e11
    cached = json.loads((tmp_path / peaks.CPU_PEAK_FILE).read_text())
    assert cached[key32]["how"] == "measured" and cached[key32 + " | bf16"]["how"] == "raised"


def test_the_metrics_logger_raises_the_peak_of_its_own_precision(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from longctx.train.metrics import MetricsLogger

    _fake_machine(monkeypatch, tmp_path)
    peaks.machine_cpu_peak(torch.float32)
    log = MetricsLogger.__new__(MetricsLogger)
    log.rt, log.say, log.local_ranks, log.peak, log.dtype = SimpleNamespace(is_main=True), lambda *a: None, 1, 7e11, \
        torch.bfloat16
    log._raise_peak(8e11)
    assert peaks.machine_cpu_peak(torch.float32)[0] == 1e11
    assert peaks.machine_cpu_peak(torch.bfloat16)[0] == 8e11


def test_pcie_cards_are_not_read_as_their_sxm_siblings(monkeypatch):
    """Matched on the device name, most specific first: the H200 NVL (PCIe, 835 TFLOP/s bf16 dense, 60 fp32) was
    read as an H200 SXM (989, 67), and so was an H800 PCIe as an H800 SXM (756 vs 989)."""
    for name, bf16, fp32 in (("NVIDIA H200 NVL", 835e12, 60e12), ("NVIDIA H200", 989e12, 67e12),
                             ("NVIDIA GH200 480GB", 989e12, 67e12), ("NVIDIA H800 PCIe", 756e12, 51e12),
                             ("NVIDIA H800", 989e12, 67e12), ("NVIDIA H100 NVL", 835e12, 60e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert peaks.device_peak(torch.device("cuda", 0), dtype=torch.bfloat16)[0] == bf16, name
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
        assert peaks.device_peak(torch.device("cuda", 0), dtype=torch.float32)[0] == fp32, name
