"""ZeRO++'s int8 blocks (parallel/fsdp/quantized.py) keep a non-finite value non-finite: a NaN or an inf
gradient must reach the step's gradient norm as one, or train.on_nonfinite's guard would apply an update
that a plain reduce-scatter would have withheld. Through qgZ's two int8 exchanges (each rank's rows
quantised, then the node's sum quantised again; fp32, FSDP's reduce dtype) and qwZ's gather (fp32 and bf16),
eager and compiled, in a whole block and in a last partial one; the other blocks stay finite, within the rounding."""

import pytest
import torch
from test_zero_pp_quant import needs_compiler

from longctx.parallel.fsdp import quantized
from longctx.parallel.fsdp.quantized import QuantizedReduceScatter, _kernel, _whole_blocks

BLOCK = 8


def _exchange(monkeypatch, parts: torch.Tensor, compiled: bool) -> torch.Tensor:
    """qgZ's _exchange of `parts` [k, m] with each peer's rows: every peer sends the same rows here (the
    all-to-all returns what was sent), so the result is the sum of the k rows through int8 blocks."""
    monkeypatch.setattr(quantized, "all_to_all", lambda packed, mesh, label: packed)
    rs = object.__new__(QuantizedReduceScatter)  # (no mesh: only _exchange's own arithmetic is used)
    rs.block, rs.compiled = BLOCK, compiled
    total, headroom = rs._exchange(parts, None, "qgz_test")  # (the sums times a power of two: 1 here)
    return total / headroom


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [2, 4 * BLOCK + 1])  # in a whole block, in the last partial one (m = 4 blocks + 3)
def test_a_non_finite_gradient_stays_non_finite_through_qgz(monkeypatch, compiled, bad, at):
    g = torch.Generator().manual_seed(at)
    k, m = 2, 4 * BLOCK + 3
    rows = torch.randn(k, m, generator=g)  # (FSDP reduces in fp32: shard.py's policies)
    rows[1, at] = bad
    plain = rows.sum(0)  # what FSDP's own reduce-scatter sums
    node_sum = _exchange(monkeypatch, rows, compiled)  # step 1, within the node
    total = _exchange(monkeypatch, torch.stack([node_sum, node_sum]), compiled)  # step 2, across nodes
    for got in (node_sum, total):
        assert not torch.isfinite(got[at]), f"{bad} at {at} came out as {got[at].item()}"
        assert not torch.isfinite(got.square().sum())  # the gradient norm the guard reads
        # every block without the bad value is the sum within the int8 rounding
        hit = at // BLOCK
        keep = torch.arange(m) // BLOCK != hit
        assert torch.isfinite(got[keep]).all()
    scale = 2 * plain[keep].abs().max()  # (the node sum's and the total's magnitudes)
    assert (total[keep] - 2 * plain[keep]).abs().max() <= 3 * scale / 127


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_weight_stays_non_finite_through_qwz(compiled, dtype):
    # qwZ's gather as FSDP's hook runs it: each rank's shard quantised (the last block partial), the rows
    # dequantised into the gather dtype
    world, n = 2, 2 * BLOCK + 3
    shards = torch.randn(world, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    shards[0, 1], shards[1, n - 1] = float("nan"), float("inf")
    q, scale = _kernel("quantize", compiled)(_whole_blocks(shards, BLOCK))
    out = torch.empty(world, n, dtype=dtype)
    _kernel("dequantize_into", compiled)(out, q, scale)
    assert not torch.isfinite(out[0, 1]) and not torch.isfinite(out[1, n - 1])
    assert torch.isfinite(out[0, BLOCK:]).all() and torch.isfinite(out[1, :2 * BLOCK]).all()
