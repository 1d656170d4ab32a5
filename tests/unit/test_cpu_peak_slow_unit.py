"""The CPU GEMM peak measurement is bounded in time on a unit that multiplies slowly.

A CPU without native bf16 multiplies 2048 x 2048 bf16 matrices in ~30 s (0.6 GFLOP/s measured on this
project's 2-core CI machine): the first bf16 run measured its peak at that fixed size, a warm-up and at
least one timed product, 4-5 minutes while the other ranks waited on a broadcast with a 300 s timeout.
Here torch.mm is replaced by a product that takes as long as such a unit would (scaled down 100x to keep
the test short), and the measurement must finish within a few times its budget and report the rate.
"""

from __future__ import annotations

import time

import torch

from longctx.costs import peaks

RATE = 60e9  # FLOP/s of the emulated unit: 2048^3 x 2 in ~0.29 s, 256^3 x 2 in 0.6 ms (100x a 0.6 GFLOP/s CPU)


def _slow_mm(a, b):
    time.sleep(2 * a.shape[0] * a.shape[1] * b.shape[1] / RATE)
    return a[:1, :1]


def test_a_slow_unit_is_measured_within_its_budget(monkeypatch):
    monkeypatch.setattr(peaks.torch, "mm", _slow_mm)
    t0 = time.perf_counter()
    flops = peaks.measure_cpu_gemm_peak(size=2048, seconds=0.02, dtype=torch.bfloat16)
    took = time.perf_counter() - t0
    # a fixed 2048 would take a warm-up and a timed product: 2 x 0.29 s; growing stops at the size whose
    # product takes >= seconds / 8
    assert took < 0.2, f"the measurement took {took:.2f} s on a budget of 0.02 s"
    assert 0.3 * RATE < flops <= 1.05 * RATE, flops


def test_a_fast_unit_still_reaches_the_largest_size(monkeypatch):
    sizes = []
    real = torch.mm

    def counting(a, b):
        sizes.append(a.shape[0])
        return real(a[:1], b[:, :1])  # instant

    monkeypatch.setattr(peaks.torch, "mm", counting)
    peaks.measure_cpu_gemm_peak(size=2048, seconds=0.05)
    assert max(sizes) == 2048 and sizes[0] == 256, sizes[:8]
