"""Review of qgZ's overflow fix (parallel/fsdp/quantized.py, QuantizedReduceScatter), against docs/parallelism.md:

- the rounding band within which a sum past the output dtype's largest value saturates was fp32's, whatever the
  gradients' dtype: fp16 gradients (FSDP2's reduce dtype where the parameters are fp16) whose sum passed 65504 came
  back 65504, never inf, where fp16's own reduce-scatter gives inf (and a loss scaler looks for it);
- the float64 node sums (2026-12-07) took 1.7-2.5x the time of the fp32 ones on one CPU core for a 64M-element
  unit, and held the whole unit's received rows as float64 twice over (+0.5-1 GiB there): the sums are fp32 again,
  times a power of two (a headroom) only where gradients near fp32's largest value could overflow them, so no
  tensor of the unit's size is float64, and ordinary gradients sum to the fp32 sums' very bits.
The hook runs in one process (tests/qgz_emulation119.py: a thread a rank)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.parallel.fsdp import quantized

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/: the in-process emulation)
from qgz_emulation119 import qgz_reduce  # noqa: E402

TOP = torch.finfo(torch.float32).max
LAYOUTS = [(1, 2), (2, 1), (2, 2), (1, 3), (3, 2)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nodes,local", [(1, 2), (2, 1), (2, 2)])
def test_a_sum_past_the_gradient_dtypes_largest_value_is_inf_as_its_own_sum(dtype, nodes, local):
    top, size = torch.finfo(dtype).max, nodes * local
    for share, finite in ((1.0 / size, True), (1.4 / size, False), (1.0, False)):
        grads = torch.full((size, size * 3), share * top, dtype=torch.float64).to(dtype)
        own = grads.float().sum(0).to(dtype)  # dtype's own sum
        out = qgz_reduce(grads, nodes, local, block=2)
        assert out.dtype == dtype and bool(own.isfinite().all()) == finite
        assert torch.equal(out.isfinite(), own.view(size, -1).isfinite()), \
            f"{size} x {share:.3g} x {top:.6g} in {dtype}: {out[:, 0].tolist()}, its own sum {own[0].item()}"
        if finite:
            assert ((out.double() - own.view(size, -1).double()).abs() <= top / 127 * size).all()


class _Float64Sizes(TorchDispatchMode):
    """The largest float64 tensor any op makes (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("nodes,local", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("near_top", [False, True])
def test_no_tensor_of_the_units_size_is_float64(monkeypatch, nodes, local, near_top):
    """One rank's call (the all-to-alls give it its own rows back): float64 only per block (the headroom's bound),
    never per value, also where the headroom scales the sums."""
    size, n, block = nodes * local, 4096, 64
    grads = torch.randn(size * n, generator=torch.Generator().manual_seed(size))
    if near_top:
        grads[::97] = TOP / 1.5
    monkeypatch.setattr(quantized, "all_to_all", lambda packed, mesh, label: packed)
    rs = object.__new__(quantized.QuantizedReduceScatter)
    rs.block, rs.compiled, rs.size, rs._ours = block, False, size, {"g": True}
    rs.mesh = {"inter": SimpleNamespace(size=lambda: nodes), "intra": SimpleNamespace(size=lambda: local)}
    out = torch.empty(n)
    with _Float64Sizes() as seen:
        rs(out, grads, SimpleNamespace(group_name="g"), torch.distributed.ReduceOp.SUM)
    assert seen.largest <= size * n // block + 1, f"a float64 tensor of {seen.largest} values (unit: {size * n})"
    assert out.isfinite().all()


def _fp32_exchanges(grads: torch.Tensor, nodes: int, local: int, block: int) -> torch.Tensor:
    """docs' two exchanges in numpy, fp32 throughout (the sums in peer order): [size, n]."""
    size, n = nodes * local, grads.shape[1] // (nodes * local)

    def through_int8(row: np.ndarray) -> np.ndarray:
        q, scale = quantized.quantize_blocks(torch.from_numpy(row), block)
        return quantized.dequantize_blocks(q, scale, row.size, torch.float32).numpy()

    g = grads.numpy().reshape(nodes, local, nodes, local, n)  # [sender node, sender local, node, local, n]
    out = np.zeros((nodes, local, n), np.float32)
    for b in range(local):
        node_sums = []
        for a in range(nodes):  # rank (a, b): its node's rows bound for local index b, on every node
            rows = [g[a, s, :, b].reshape(-1) for s in range(local)]
            total = rows[0].copy() if local == 1 else np.zeros(nodes * n, np.float32)
            for row in rows if local > 1 else []:
                total = (total + through_int8(row)).astype(np.float32)
            node_sums.append(total.reshape(nodes, n))
        for t in range(nodes):  # rank (t, b) sums every node's sum bound for node t
            parts = [s[t] for s in node_sums]
            total = parts[0].copy() if nodes == 1 else np.zeros(n, np.float32)
            for part in parts if nodes > 1 else []:
                total = (total + through_int8(part)).astype(np.float32)
            out[t, b] = total
    return torch.from_numpy(out.reshape(size, n))


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_ordinary_gradients_sum_to_the_fp32_sums_bits(nodes, local):
    """A headroom of 1 (no gradient near fp32's largest value): the fp32 sums of before 2026-12-07, bit for bit."""
    size, n, block = nodes * local, 301, 16
    g = torch.Generator().manual_seed(10 * nodes + local)
    grads = torch.randn(size, size * n, generator=g) * torch.logspace(-30, 30, size * n)
    out = qgz_reduce(grads, nodes, local, block)
    assert torch.equal(out, _fp32_exchanges(grads, nodes, local, block))


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_a_headroom_keeps_the_sum_and_small_values_beside_huge_ones(nodes, local):
    """Gradients near fp32's largest value in one block: that block sums as the exact sum within the rounding, and
    the other blocks' values (1e-30 .. 1e30) are the fp32 exchanges' within fp32's rounding, not flushed."""
    size, n, block = nodes * local, 64, 8
    g = torch.Generator().manual_seed(nodes + 7 * local)
    grads = torch.randn(size, size * n, generator=g) * torch.logspace(-30, 30, size * n)
    grads[:, :block] = TOP / size * 0.9  # every chunk's first block: the sum 0.9 x fp32's largest value
    out = qgz_reduce(grads, nodes, local, block)
    assert out.isfinite().all()
    exact = grads.double().sum(0).view(size, n)
    band = size * TOP / 254 * ((local > 1) + (nodes > 1)) * (1 + 1e-3)  # (docs: half a step per summand)
    assert ((out[:, :block].double() - exact[:, :block]).abs() <= band).all()
    want = _fp32_exchanges(grads, nodes, local, block)[:, block:].double()
    assert ((out[:, block:].double() - want).abs() <= 2.0 ** -20 * want.abs()).all()


@pytest.mark.parametrize("nodes,local", [(1, 8), (8, 1), (2, 4)])
@pytest.mark.parametrize("avg", [False, True])
def test_the_headroom_bounds_the_sum_of_the_rows_not_the_largest_row(nodes, local, avg):
    """Four gradients of 0.7 x fp32's largest value, then four of -0.6: their sum (0.4 x it) is finite, the first
    four's 2.8 x (in peer order or pairwise, whichever the sum takes); a headroom of 1/2, the largest row's, overflowed
    it (1/8 does not)."""
    values = [0.7] * 4 + [-0.6] * 4
    grads = (torch.tensor(values, dtype=torch.float64) * TOP).float()[:, None].repeat(1, 8 * 3)
    out = qgz_reduce(grads, nodes, local, block=3, avg=avg)
    exact = 0.4 * TOP / (8 if avg else 1)
    assert out.isfinite().all(), out[:, 0]
    assert ((out.double() - exact).abs() <= 8 * 2 * TOP / 254 / (8 if avg else 1)).all()
