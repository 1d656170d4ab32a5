"""A randomized audit of ZeRO++'s int8 blocks (parallel/fsdp/quantized.py) against a reference written here, in
numpy, from docs/parallelism.md's words ("Over slow links between nodes: ZeRO++"): blocks of parallel.zero_pp_block
elements, the last padded with zeros; one fp32 scale a block, its largest magnitude / 127; each value divided by it
(fp32) and rounded to the nearest int8 level, ties to even (torch.round's); dequantised as level x scale (fp32) and
then cast to the gather dtype. So each value of a block comes back within half a step (scale / 2) of what was sent,
plus, where the scale is subnormal (a block under 127 x fp32's smallest normal), that scale's own rounding (at most
127 half-ulps of 2^-149: under 1e-43). A non-finite value never comes back finite.

Random sizes (under one block, one block, whole blocks, a partial last one), block sizes (1 .. 512), gather dtypes
(fp32, bf16) and values (zero blocks, one huge outlier, subnormals, negative-only, constant blocks, exact ties,
nan / inf); qwZ's dequantisation as its hook runs it (rows of every rank's shard into FSDP's buffer) and qgZ's
exchange (the rows a rank receives, dequantised and summed in fp32 times its headroom); eager kernels everywhere,
compiled for two cases.
tests/distributed/test_zeropp_fuzz118_ranks.py runs the hooks over 4 ranks against the same reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_zero_pp_quant import needs_compiler

from longctx.parallel.fsdp import quantized
from longctx.parallel.fsdp.quantized import QuantizedReduceScatter, _kernel, dequantize_blocks, quantize_blocks

LEVELS = np.float32(127)  # docs: "one fp32 scale each (the block's largest magnitude / 127)"
FP32_MAX = np.finfo(np.float32).max


def _largest_scale() -> np.float32:
    """docs: the scale is capped where level 127 would overflow fp32 (a block at fp32's largest values)."""
    scale = np.float32(FP32_MAX / np.float64(127))
    with np.errstate(over="ignore"):
        while not np.isfinite(scale * LEVELS):
            scale = np.nextafter(scale, np.float32(0))
    return scale


MAX_SCALE = _largest_scale()
SUBNORMAL_SLACK = 127 * 2.0 ** -150  # a subnormal scale's own rounding, times the largest level
DISTRIBUTIONS = ("normal", "block magnitudes", "zero blocks", "outlier", "subnormal", "negative", "constant", "ties")


# ---------------------------------------------------------------------------------------------------------------
# the reference


def ref_quantize(x, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The flat values `x` (read as fp32; float64 ones, qgZ's node sums, as they are) -> (int8 levels [blocks,
    block], fp32 scales [blocks]). A float64 block's scale is its largest magnitude / 127 rounded once to fp32,
    uncapped, and each value is divided in float64, the quotient rounded to fp32. A nan quotient (a non-finite
    block) is level 0, so that the block comes back nan (docs)."""
    x = torch.as_tensor(x)
    wide = x.dtype == torch.float64
    work = np.float64 if wide else np.float32
    x = np.asarray((x if wide else x.float()).reshape(-1).numpy(), work)
    blocks = -(-x.size // block)
    padded = np.zeros(blocks * block, work)
    padded[:x.size] = x
    rows = padded.reshape(blocks, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        biggest = np.abs(rows).max(axis=1) if blocks else np.zeros(0, np.float32)  # (numpy's max keeps a nan)
        scale = (biggest / work(LEVELS)).astype(np.float32)
        if not wide:
            scale = np.where(np.isinf(scale), scale, np.minimum(scale, MAX_SCALE)).astype(np.float32)  # (nan stays)
        safe = np.where(scale > 0, scale, np.float32(1)).astype(work)
        levels = np.clip(np.rint((rows / safe[:, None]).astype(np.float32)), -127, 127)
    return np.where(np.isfinite(levels), levels, 0).astype(np.int8), scale


def ref_dequantize(levels: np.ndarray, scale: np.ndarray, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `n` values of ref_quantize's blocks, level x scale in fp32, then in the gather dtype (float64:
    qgZ's sums, level x scale in float64, exact)."""
    work = np.float64 if dtype == torch.float64 else np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        values = (levels.astype(work) * scale.astype(work)[:, None]).reshape(-1)[:n]
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def ref_bound(x: torch.Tensor, scale: np.ndarray, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Per element: half its block's step (plus a subnormal scale's slack), plus the gather dtype's own rounding
    of the result (half a bf16 ulp; nothing for fp32)."""
    step = torch.from_numpy(scale.astype(np.float64)).repeat_interleave(block)[:x.numel()]
    cast = x.double().abs() * 2.0 ** -8 + 2.0 ** -133 if dtype == torch.bfloat16 else 0.0
    return step / 2 * (1 + 1e-6) + SUBNORMAL_SLACK + cast


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit as values (nan equal to nan)."""
    return a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a.float(), nan=7.5), torch.nan_to_num(
        b.float(), nan=7.5)) and torch.equal(a.float().isnan(), b.float().isnan()))


# ---------------------------------------------------------------------------------------------------------------
# random cases


def values(n: int, block: int, kind: str, rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** rng.uniform(-4, 4)
    blocks = torch.arange(n) // block
    if kind == "block magnitudes":
        x = x * 10.0 ** (torch.rand(-(-n // block), generator=g, dtype=torch.float64) * 12 - 6)[blocks]
    elif kind == "zero blocks":
        x = x * (torch.rand(-(-n // block), generator=g) < 0.5)[blocks]
    elif kind == "outlier" and n:
        big = [1e6, -3e38, 1e30, float(FP32_MAX), -float(FP32_MAX)] if dtype == torch.float32 else [1e6, -3e38]
        x[rng.randrange(n)] = rng.choice(big)
    elif kind == "subnormal":
        x = x / x.abs().max().clamp_min(1e-300) * rng.choice([1e-39, 1e-41, 1e-43, 3e-44, 1e-44])
    elif kind == "negative":
        x = -x.abs()
    elif kind == "constant":
        x = torch.full((n,), rng.choice([1.0, -0.3, 7e-3, 1e-40]), dtype=torch.float64)
    elif kind == "ties":  # largest 127 (a scale of 1 exactly), the rest on half levels: where the tie rule shows
        x = torch.randint(-126, 126, (n,), generator=g).double() + 0.5
        x[torch.arange(0, n, block)] = 127.0
    return x.to(dtype)


def random_cases(count: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        block = rng.choice([1, 2, 3, 5, 8, 17, 64, 100, 512])
        n = rng.choice([1, max(1, block - 1), block, block + 1, 3 * block + rng.randrange(1, block + 1),
                        rng.randrange(1, 3000)])
        dtype = torch.float32 if i % 3 else torch.bfloat16
        cases.append((n, block, dtype, DISTRIBUTIONS[i % len(DISTRIBUTIONS)], rng.randrange(1, 5), seed * 1000 + i))
    return cases


CASES = random_cases(48, 118)


def _ids(case) -> str:
    n, block, dtype, kind, world, seed = case
    return f"n{n}-b{block}-{str(dtype)[6:]}-{kind.replace(' ', '_')}-w{world}"


# ---------------------------------------------------------------------------------------------------------------
# qwZ: a shard's blocks, and every rank's rows dequantised into the gather's buffer


def check_blocks(x: torch.Tensor, block: int, dtype: torch.dtype, compiled: bool) -> None:
    """One shard against the reference: levels, scales, dequantised values, the bound."""
    q, scale = quantize_blocks(x, block, compiled)
    want_q, want_scale = ref_quantize(x, block)
    finite = np.isfinite(want_scale)
    assert q.dtype == torch.int8 and q.numel() == want_q.size and scale.dtype == torch.float32
    assert same(scale, torch.from_numpy(want_scale)), "scales: not the block's largest magnitude / 127"
    got_q = q.view(-1, block).numpy()  # (a non-finite block's too: level 0 for a nan quotient)
    assert np.array_equal(got_q, want_q), f"levels differ at {np.argwhere(got_q != want_q)[:4].tolist()}"
    back = dequantize_blocks(q, scale, x.numel(), dtype)
    assert back.dtype == dtype and same(back, ref_dequantize(want_q, want_scale, x.numel(), dtype))
    ok = torch.from_numpy(finite).repeat_interleave(block)[:x.numel()]  # (a non-finite block: below)
    err = (back.double() - x.double()).abs()[ok]
    assert torch.all(err <= ref_bound(x, want_scale, block, dtype)[ok]), f"off by {err.max().item()}"


def check_rows(shards: torch.Tensor, block: int, compiled: bool) -> None:
    """qwZ's hook: each rank's shard quantised by itself, every row dequantised into FSDP's [world, n] buffer
    (the gather dtype) by the kernel the hook runs."""
    world, n = shards.shape
    pairs = [quantize_blocks(s, block, compiled) for s in shards]
    q = torch.stack([p[0] for p in pairs]).view(world, -1, block)
    scale = torch.stack([p[1] for p in pairs])
    out = torch.full((world, n), 99.0, dtype=shards.dtype)  # (a stale buffer: every value must be written)
    _kernel("dequantize_into", compiled)(out, q, scale)
    for r in range(world):
        want = ref_dequantize(*ref_quantize(shards[r], block), n, shards.dtype)
        assert same(out[r], want), f"rank {r}'s row: off by {(out[r].float() - want.float()).abs().max().item()}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_int8_blocks_match_the_documented_quantisation(case):
    n, block, dtype, kind, world, seed = case
    rng = random.Random(seed)
    shards = torch.stack([values(n, block, kind, rng, dtype) for _ in range(world)])
    for shard in shards:
        check_blocks(shard, block, dtype, compiled=False)
    check_rows(shards, block, compiled=False)


@needs_compiler
@pytest.mark.parametrize("case", [CASES[3], CASES[28]], ids=_ids)  # (compiling costs seconds: two cases)
def test_compiled_kernels_match_the_documented_quantisation(case):
    n, block, dtype, kind, world, seed = case
    rng = random.Random(seed)
    shards = torch.stack([values(n, block, kind, rng, dtype) for _ in range(world)])
    check_blocks(shards[0], block, dtype, compiled=True)
    check_rows(shards, block, compiled=True)
    check_exchange(shards.float(), block, compiled=True)


def test_a_tie_rounds_to_even_and_the_largest_magnitude_comes_back_exact():
    x = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -127.0, 0.0])
    q, scale = quantize_blocks(x, 8)
    assert scale.tolist() == [1.0] and q.tolist() == [127, 2, -4, 0, 0, 126, -127, 0]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)])
def test_a_block_at_fp32s_largest_values_comes_back_finite(compiled):
    """Its scale, fp32's largest value / 127 rounded up, made 127 x it overflow: a finite weight (or a node's summed
    gradient) came back inf, and train.on_nonfinite then skipped the step (before 2026-12-07)."""
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, 1.0, torch.nextafter(torch.tensor(top), torch.tensor(0.0)).item()])
    q, scale = quantize_blocks(x, 2, compiled)
    back = torch.empty(1, 4)
    _kernel("dequantize_into", compiled)(back, q.view(1, 2, 2), scale.view(1, 2))
    assert torch.isfinite(back).all(), f"{x.tolist()} came back {back.tolist()}"
    assert torch.all((back[0].double() - x.double()).abs() <= scale.double().repeat_interleave(2) / 2)
    summed = exchange(torch.tensor([[top, 1.0], [0.0, -1.0]]), 2, compiled)  # qgZ's summands alike
    assert torch.isfinite(summed).all(), f"qgz's sum of {top} and 0 came back {summed.tolist()}"


# ---------------------------------------------------------------------------------------------------------------
# non-finite values: "a nonfinite must not become a silent finite"

BAD = (float("nan"), float("inf"), -float("inf"))


@pytest.mark.parametrize("case", CASES[::4], ids=_ids)
def test_a_non_finite_value_never_comes_back_finite(case):
    n, block, dtype, kind, world, seed = case
    rng = random.Random(seed)
    shards = torch.stack([values(n, block, kind, rng, dtype) for _ in range(world)])
    where = [(rng.randrange(world), rng.randrange(n)) for _ in range(rng.randrange(1, 3))]
    for r, i in where:
        shards[r, i] = rng.choice(BAD)
    check_rows(shards, block, compiled=False)  # the other blocks as the reference; the bad ones too (nan)
    pairs = [quantize_blocks(s, block) for s in shards]
    for r, i in where:
        back = dequantize_blocks(*pairs[r], n, dtype)
        assert not torch.isfinite(back[i]), f"{shards[r, i].item()} came back as {back[i].item()}"
    summed = exchange(shards.float(), block, compiled=False)
    for _, i in where:
        assert not torch.isfinite(summed[i]), f"a sum with a non-finite summand came back {summed[i].item()}"


# ---------------------------------------------------------------------------------------------------------------
# qgZ: the rows a rank receives, dequantised and summed


def exchange(rows: torch.Tensor, block: int, compiled: bool) -> torch.Tensor:
    """QuantizedReduceScatter._exchange's arithmetic on [k, m] rows, the all-to-all returning the rows sent
    (so the k rows arrive as if from k peers); tests/distributed/test_zeropp_fuzz118_ranks.py runs the real one."""
    rs = object.__new__(QuantizedReduceScatter)
    rs.block, rs.compiled = block, compiled
    original = quantized.all_to_all
    quantized.all_to_all = lambda packed, mesh, label: packed
    try:
        total, headroom = rs._exchange(rows.clone(), None, "qgz_fuzz")  # (fp32 sums times a power of two)
        return total.double() / headroom.double()
    finally:
        quantized.all_to_all = original


def ref_exchange(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the k rows, each through its own int8 blocks, dequantised and summed in float64; the bound on that sum's
    error against the exact sum of the rows: each summand's half step). One row is sent as it is."""
    k, m = rows.shape
    if k == 1:
        return rows[0].double(), torch.zeros(m, dtype=torch.float64)
    total, bound = torch.zeros(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    for row in rows:
        levels, scale = ref_quantize(row, block)
        total += ref_dequantize(levels, scale, m, torch.float64)
        bound += ref_bound(row, scale, block, torch.float32)
    return total, bound


def check_exchange(rows: torch.Tensor, block: int, compiled: bool) -> None:
    got = exchange(rows, block, compiled)
    want, bound = ref_exchange(rows, block)
    ok = want.isfinite()
    assert got.shape == (rows.shape[1],)
    # the same summands as the reference, summed in fp32 times qgZ's headroom (k of them: an order's rounding apart;
    # under a headroom of 2^-e, a subnormal summand loses its lowest e bits)
    terms = rows.double().abs().sum(0) + bound
    assert torch.all((got.double() - want)[ok].abs() <= (rows.shape[0] * (2.0 ** -23 * terms + 2.0 ** -146))[ok])
    exact = rows.double().sum(0)
    assert torch.all((got.double() - exact)[ok].abs() <= (bound + rows.shape[0] * 2.0 ** -23 * terms)[ok])


@pytest.mark.parametrize("case", CASES[::3], ids=_ids)
def test_qgz_sums_each_peers_int8_rows(case):
    n, block, dtype, kind, world, seed = case
    rng = random.Random(seed)
    rows = torch.stack([values(n, block, kind, rng, torch.float32) for _ in range(world)])  # (FSDP reduces fp32)
    check_exchange(rows, block, compiled=False)
