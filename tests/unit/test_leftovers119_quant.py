"""Leftovers of ZeRO++'s int8 kernels (parallel/fsdp/quantized.py), against docs/parallelism.md:

- qgZ summed the dequantised gradients in fp32: gradients near fp32's largest value whose exact sum is finite
  (two halves of it, or a node's sum that the next node's cancels) came back inf or nan, where fp32's own
  reduce-scatter returns inf only where the sum itself passes fp32's largest value. The hook is run here in one
  process (tests/qgz_emulation119.py: a thread a rank); tests/distributed/test_leftovers119_quant_ranks.py runs
  it over gloo ranks against gloo's fp32 reduce-scatter.
- The compiled kernels cast a non-finite block's nan ratios to int8 as -128 (eager: 0), so an inf came back -inf
  (and a level lay outside +-127); an all-zero block holding a -0.0 had the scale -0.0. Both kernels now give
  a non-finite block back as nan, bit for bit alike."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from test_zero_pp_quant import needs_compiler

from longctx.parallel.fsdp import quantized
from longctx.parallel.fsdp.quantized import QuantizedReduceScatter, _kernel, _whole_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/: the in-process emulation)
from qgz_emulation119 import qgz_reduce  # noqa: E402

TOP = torch.finfo(torch.float32).max
STEP = TOP / 127  # a block's largest step: its scale at fp32's largest magnitude
LAYOUTS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 3)]  # (nodes, ranks per node) of the FSDP group


def _chunks_alike(values: list[float], n: int = 1) -> torch.Tensor:
    """[size, size x n]: rank r's gradients, every chunk holding values[r] x fp32's largest value."""
    size = len(values)
    return (torch.tensor(values, dtype=torch.float64) * TOP).float()[:, None].repeat(1, size * n)


def _band(nodes: int, local: int) -> float:
    """docs: each exchange moves each summand by at most half a step of its block (a node's sum: up to `local`
    gradients), so a sum is within this of the exact one (plus fp32's own rounding of the sums: 2^-24 a term)."""
    size = nodes * local
    return size * (STEP / 2 + size * TOP * 2.0 ** -23) * ((local > 1) + (nodes > 1))


@pytest.mark.parametrize("nodes,local,values", [
    (1, 2, [0.5, 0.5]),  # within the node: fp32's largest value exactly (inf before)
    (2, 1, [0.5, 0.5]),  # across nodes, alike (inf before)
    (2, 2, [0.75, 0.75, -0.75, -0.5]),  # node 0's sum is 1.5 x the largest, node 1's cancels it (nan before)
    (1, 4, [0.75, 0.75, -0.75, -0.5]),  # the four in one node (inf before)
])
@pytest.mark.parametrize("avg", [False, True])
def test_qgz_sums_near_fp32s_largest_value_come_back_finite_where_the_sum_is(nodes, local, values, avg):
    grads = _chunks_alike(values, n=3)
    out = qgz_reduce(grads, nodes, local, block=2, avg=avg)
    exact = grads.double().sum(0)[0] / (len(values) if avg else 1)
    assert torch.isfinite(out).all(), f"{values} x {TOP:.4g} (exact sum {exact.item():.6g}) came back {out[:, 0]}"
    band = _band(nodes, local) / (len(values) if avg else 1)
    assert (out.double() - exact).abs().max() <= band, f"{out[:, 0].tolist()} against {exact.item()}"


@pytest.mark.parametrize("nodes,local", [(1, 2), (2, 1), (2, 2)])
def test_a_sum_past_fp32s_largest_value_is_still_inf(nodes, local):
    """Beyond the rounding band the exact sum is past fp32's largest value: inf, as fp32's own sum gives."""
    out = qgz_reduce(_chunks_alike([1.0] * (nodes * local)), nodes, local, block=1)
    assert torch.isinf(out).all() and (out > 0).all(), out


def _near_top_grads(size: int, n: int, rng: random.Random) -> torch.Tensor:
    """Gradients of magnitude 0.1 .. 1 x fp32's largest value, most sums cancelling to within it, and a few
    small values in the same blocks."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    signs = torch.where(torch.rand(size, size * n, generator=g) < 0.5, -1.0, 1.0).double()
    magnitude = 0.1 + 0.9 * torch.rand(size, size * n, generator=g, dtype=torch.float64)
    grads = signs * magnitude * TOP / (1 + rng.random() * size / 2)
    grads[torch.rand(size, size * n, generator=g) < 0.1] *= 1e-30
    return grads.float()


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_qgz_is_inf_only_where_fp32s_reduce_scatter_is(nodes, local):
    rng = random.Random(nodes * 10 + local)
    size = nodes * local
    for _ in range(3):
        block, n = rng.choice([1, 3, 8]), rng.choice([5, 16, 33])
        grads = _near_top_grads(size, n, rng)
        out = qgz_reduce(grads, nodes, local, block).reshape(-1)
        exact = grads.double().sum(0)
        plain = grads.sum(0)  # fp32 in rank order (one of the orders a reduce-scatter may take)
        assert not out.isnan().any()
        # finite wherever the exact sum is within fp32's range (the fp32 sum in any order is, but for its own
        # rounding at the very top), inf only where it is past it
        assert torch.isfinite(out[exact.abs() <= TOP]).all(), "a finite sum came back inf"
        assert (exact[out.isinf()].abs() > TOP).all(), "inf where the exact sum is finite"
        ok = out.isfinite() & plain.isfinite()
        assert ((out.double() - exact).abs()[ok] <= _band(nodes, local)).all()


# ---------------------------------------------------------------------------------------------------------------
# non-finite and signed-zero blocks: eager against compiled

INF, NAN = float("inf"), float("nan")
BLOCKS = [[NAN, 1.0, 2.0, 3.0], [INF, 1.0, 2.0, 3.0], [-INF, 1.0, 2.0, 3.0], [-0.0, 0.0, -0.0, 0.0],
          [INF, -INF, 1.0, 0.0], [-0.0, -1.0, 2.0, NAN], [NAN, INF, -INF, -0.0], [1.0, 2.0, -INF, -0.0],
          [INF, INF, INF, INF], [-INF, -0.0, -0.0, -0.0], [0.0, 0.0, 0.0, 0.0], [TOP, -TOP, INF, 1e-40]]


def _run(blocks: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, ...]:
    """What the hooks run on `blocks` [rows, 4]: quantise (one block a row), dequantise into a buffer (qwZ),
    dequantise and sum pairs of rows (qgZ), and that node sum quantised again."""
    q, scale = _kernel("quantize", compiled)(_whole_blocks(blocks, 4))
    out = torch.empty_like(blocks)
    _kernel("dequantize_into", compiled)(out, q, scale)
    rows = len(blocks) // 2 * 2
    summed = _kernel("dequantize_sum", compiled)(q[:rows].view(2, -1, 4), scale[:rows].view(2, -1))
    q2, scale2 = _kernel("quantize", compiled)(_whole_blocks(summed.view(1, -1), 4))
    return q, scale, out, summed, q2, scale2


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, every nan alike (its sign and payload are not specified)."""
    if not t.is_floating_point():
        return t
    t = torch.where(t.isnan(), torch.full_like(t, NAN), t).float() if t.dtype != torch.float64 else \
        torch.where(t.isnan(), torch.full_like(t, NAN), t)
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _check_the_documented_promise(blocks: torch.Tensor, q, scale, out) -> None:
    bad = ~torch.isfinite(blocks).all(1)
    assert (q.abs() <= 127).all(), "a level outside +-127"
    assert out[bad].isnan().all(), f"a non-finite block came back {out[bad].tolist()}, not nan"
    assert torch.isfinite(out[~bad]).all()
    assert not (scale.view(-1).signbit() & ~scale.view(-1).isnan()).any(), "a negative scale (-0.0)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_kernels_give_a_non_finite_block_back_as_nan(dtype):
    blocks = torch.tensor(BLOCKS).to(dtype)
    q, scale, out, _, _, _ = _run(blocks, compiled=False)
    _check_the_documented_promise(blocks.float(), q, scale, out.float())


@needs_compiler
def test_compiled_kernels_give_non_finite_and_zero_blocks_the_eager_bits():
    """(Compiling the kernels takes a few seconds a graph on this CPU: one test for all the cases.)"""
    for dtype in (torch.float32, torch.bfloat16):
        blocks = torch.tensor(BLOCKS).to(dtype)
        eager, compiled = _run(blocks, False), _run(blocks, True)
        _check_the_documented_promise(blocks.float(), *compiled[:2], compiled[2].float())
        for name, a, b in zip(["levels", "scales", "dequantised", "summed", "node levels", "node scales"],
                              eager, compiled):
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), f"{dtype} {name}: {a} != {b}"
    # and qgZ's node sum of two halves of fp32's largest value through the compiled kernels (inf before)
    rs = object.__new__(QuantizedReduceScatter)
    rs.block, rs.compiled = 1, True
    original, quantized.all_to_all = quantized.all_to_all, lambda packed, mesh, label: packed
    try:
        node_sum, headroom = rs._exchange(torch.tensor([[TOP / 2, 1.0], [TOP / 2, -1.0]]), None, "qgz_test")
        node_sum = node_sum.double() / headroom.double()  # (fp32 sums times a power of two)
    finally:
        quantized.all_to_all = original
    assert torch.isfinite(node_sum).all() and abs(node_sum[0].item() - TOP) <= STEP, node_sum
