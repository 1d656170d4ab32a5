"""A randomized audit of ZeRO++'s hooks over 4 gloo ranks against the reference in
tests/unit/test_zeropp_fuzz118.py (docs/parallelism.md's int8 blocks, written there in numpy):
- qwZ (QuantizedAllGather) over the whole group, over pairs of consecutive and of strided ranks, with and without an
  hpz partition (a gather no larger than it is exact), random shard sizes, blocks, gather dtypes and values; and
  through FSDP2 itself on a layer whose rows do not split evenly over the ranks (the last rank's shard padding);
- qgZ (QuantizedReduceScatter) on every node split of 4 ranks (1 x 4, 2 x 2, 4 x 1) and with 2 replicas (1 x 2,
  2 x 1 each), SUM and AVG: the output equals the two int8 exchanges (within the node first) simulated from every
  rank's gradients, and lies within the documented rounding of the exact sum over the FSDP group's ranks, the right
  ones; a non-finite gradient reaches its owner non-finite;
- hpZ: a few training steps on the debug model against plain FSDP (equal within 1e-6, as documented), the secondary
  partition's size (a node, or parallel.hpz_ranks), and hpz with qwz rounding the weights once (as qwz alone)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # (the reference, in the unit audit)

from test_zero_pp import _losses, _post_forward_groups  # noqa: E402
from test_zero_pp_quant import _has_compiler, needs_compiler  # noqa: E402
from test_zeropp_fuzz118 import (  # noqa: E402
    BAD,
    DISTRIBUTIONS,
    FP32_MAX,
    random_cases,
    ref_bound,
    ref_dequantize,
    ref_quantize,
    same,
    values,
)

from longctx.job.spawn import run_spawned_many  # noqa: E402

pytestmark = pytest.mark.slow

# (dp_replicate, nodes, ranks per node) over 4 ranks: each replica an FSDP group of nodes x ranks per node
LAYOUTS = [(1, 2, 2), (1, 1, 4), (1, 4, 1), (2, 1, 2), (2, 2, 1)]


def _shards(case, world):
    n, block, dtype, kind, _, seed = case
    rng = random.Random(seed)
    return [values(n, block, kind, rng, dtype) for _ in range(world)]


def _gather_cases(seed: int, compiled: bool = False) -> list[str]:
    """QuantizedAllGather on random cases and groups; the problems found (none: [])."""
    import torch
    import torch.distributed as dist

    from longctx.parallel.fsdp.quantized import QuantizedAllGather

    rank, problems = dist.get_rank(), []
    groups = {"all": (dist.group.WORLD, [0, 1, 2, 3]), "pairs": None, "strided": None}
    pairs, strided = [dist.new_group([0, 1]), dist.new_group([2, 3])], [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups["pairs"] = (pairs[rank // 2], [[0, 1], [2, 3]][rank // 2])
    groups["strided"] = (strided[rank % 2], [[0, 2], [1, 3]][rank % 2])
    for i, case in enumerate(random_cases(6 if compiled else 16, seed)):
        name, (group, members) = list(groups.items())[i % 3]
        node_group = (0, 2, 4)[i % 3 if not compiled else 0]
        shards = _shards(case, 4)
        n, block, dtype = case[0], case[1], case[2]
        comm = QuantizedAllGather(block, node_group=node_group, compiled=compiled)
        out = torch.full((len(members) * n,), 99.0, dtype=dtype)
        comm(out, shards[rank].clone(), group)
        exact = len(members) <= node_group  # hpz's gather within its partition: the dequantised copy, as it is
        for j, r in enumerate(members):
            want = shards[r] if exact else ref_dequantize(*ref_quantize(shards[r], block), n, dtype)
            if not same(out[j * n:(j + 1) * n], want):
                problems.append(f"case {case[:5]} over {name} (hpz partition {node_group}): rank {r}'s row differs")
        blocks = -(-n // block)
        sent = n * shards[0].element_size() if exact else blocks * block + 4 * blocks
        if comm.sent_bytes != sent:
            problems.append(f"case {case[:5]}: sent {comm.sent_bytes} bytes, expected {sent}")
    return problems


def _uneven_fsdp(seed: int) -> list[str]:
    """FSDP2's own all-gather input through qwZ: Linear layers whose rows do not split over 4 ranks (FSDP pads each
    rank's shard; the last ranks' are partly or wholly padding), gathered in fp32 and in bf16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from longctx.parallel.fsdp.quantized import QuantizedAllGather

    rng, problems, mesh = random.Random(seed), [], init_device_mesh("cpu", (4,))
    for rows, cols, dtype in [(3, 5, torch.float32), (7, 37, torch.float32), (7, 37, torch.bfloat16),
                              (rng.randrange(1, 11), rng.randrange(1, 40), torch.float32)]:
        torch.manual_seed(seed + rows)
        layer = torch.nn.Linear(cols, rows)
        full = [p.detach().clone().to(dtype) for p in (layer.weight, layer.bias)]
        per = -(-rows // 4)  # FSDP2's dim-0 chunk, each rank's padded to it
        block = rng.randrange(1, per * (cols + 1) + 1)
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        layer.set_custom_all_gather(QuantizedAllGather(block))
        seen = {}
        layer.register_forward_pre_hook(  # (after FSDP's own: the gathered parameters)
            lambda m, a, seen=seen: seen.update(w=m.weight.detach().clone(), b=m.bias.detach().clone()))
        layer(torch.randn(2, cols).to(dtype))
        for r in range(4):  # rank r's gather input: its weight rows, then its bias values, each padded to `per` rows
            mine = [p[r * per:(r + 1) * per] for p in full]
            padded = [torch.zeros(per, *p.shape[1:], dtype=dtype) for p in full]
            for pad, m in zip(padded, mine):
                pad[:len(m)] = m
            flat = torch.cat([pad.reshape(-1) for pad in padded])
            back = ref_dequantize(*ref_quantize(flat, block), flat.numel(), dtype)
            got_w, got_b = seen["w"][r * per:(r + 1) * per].reshape(-1), seen["b"][r * per:(r + 1) * per]
            want_w, want_b = back[:mine[0].numel()], back[per * cols:per * cols + mine[1].numel()]
            if not (same(got_w, want_w) and same(got_b, want_b)):
                problems.append(f"Linear({cols}, {rows}) {dtype} block {block}: rank {r}'s rows differ from its "
                                f"quantised shard")
        dist.barrier()
    return problems


def ref_headroom(scales: list):
    """docs: the power of two that qgZ multiplies the scales of the rows it received by before their fp32 sum: 1
    unless a block's rows' largest magnitudes (127 x their scales) add up past half of fp32's largest value, else the
    smallest power that brings the largest such sum under it. Non-finite blocks are left out."""
    import math

    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):
        bound = np.sum([s.astype(np.float64) * 127 for s in scales], axis=0)
    most = float(np.where(np.isfinite(bound), bound, 0.0).max(initial=0.0))
    return np.float32(2.0 ** -max(0, math.ceil(math.log2(most / (float(FP32_MAX) / 2)))) if most > 0 else 1.0)


def ref_reduce(grads: list, layout, rank: int, n: int, block: int):
    """The documented qgZ for `rank`'s chunk: within the node, each peer's row (the chunks bound for this rank's
    local index on every node) through int8 blocks, dequantised with its scales times the rank's headroom and summed
    in fp32 in peer order; then across nodes, each node's sum of this rank's chunk through int8 blocks (the scales of
    the sum itself: over that node's headroom), summed alike. Returns (the fp32 sum times the last headroom, that
    headroom, its bound against the exact sum); `finish` makes it the output."""
    import numpy as np
    import torch

    _, nodes, local = layout
    size = nodes * local
    first = rank - rank % size  # the replica's first rank: its FSDP group is `size` consecutive ranks
    node_t, local_t = divmod(rank - first, local)
    node_sums, bound = [], torch.zeros(n, dtype=torch.float64)
    for a in range(nodes):  # the rank (a, local_t) sums its node's rows
        rows = [grads[first + a * local + b].view(nodes, local, n)[:, local_t].reshape(-1) for b in range(local)]
        if local == 1:
            node_sums.append((rows[0].numpy().reshape(nodes, n)[node_t].copy(), np.float32(1.0)))
            continue
        quantised = [ref_quantize(row, block) for row in rows]
        headroom, total = ref_headroom([scale for _, scale in quantised]), np.zeros(nodes * n, np.float32)
        for row, (levels, scale) in zip(rows, quantised):
            total = (total + ref_dequantize(levels, scale * headroom, nodes * n, torch.float32).numpy()
                     ).astype(np.float32)
            bound += ref_bound(row, scale, block, torch.float32)[node_t * n:(node_t + 1) * n]
        node_sums.append((total.reshape(nodes, n)[node_t].copy(), headroom))
    if nodes == 1:
        return torch.from_numpy(node_sums[0][0]), node_sums[0][1], bound
    quantised = []
    for part, headroom in node_sums:
        levels, scale = ref_quantize(torch.from_numpy(part), block)
        quantised.append((levels, (scale / headroom).astype(np.float32)))
        bound += ref_bound(torch.from_numpy(part), quantised[-1][1], block, torch.float32)
    headroom, out = ref_headroom([scale for _, scale in quantised]), np.zeros(n, np.float32)
    for levels, scale in quantised:
        out = (out + ref_dequantize(levels, scale * headroom, n, torch.float32).numpy()).astype(np.float32)
    return torch.from_numpy(out), headroom, bound


def finish(total, headroom, layout, size: int, avg: bool):
    """docs: the sum (divided by the group's size for AVG) within the int8 rounding's band past fp32's largest value
    saturates at it (its exact sum may be finite), further it is inf."""
    import numpy as np
    import torch

    _, nodes, local = layout
    top, divide = float(FP32_MAX), size if avg else 1
    band = size * top * ((local > 1) + (nodes > 1)) * (1 / 254 + size * 2.0 ** -23) / divide
    divisor = np.float32(headroom) * np.float32(divide)
    with np.errstate(over="ignore", invalid="ignore"):
        edge = np.float32((top + band) * float(divisor))
        total = total.numpy()
        out = np.clip(total / divisor, -top, top)
    out[total > edge], out[total < -edge] = np.inf, -np.inf
    return torch.from_numpy(out.astype(np.float32))


def _reduce_cases(seed: int, compiled: bool = False) -> list[str]:
    """QuantizedReduceScatter on every layout, random sizes, blocks, values, SUM / AVG, a non-finite value."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from longctx.parallel.fsdp.quantized import QuantizedReduceScatter

    rank, rng, problems = dist.get_rank(), random.Random(seed), []
    for li, layout in enumerate(LAYOUTS * (1 if compiled else 2)):
        dp, nodes, local = layout
        size = nodes * local
        groups = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(dp)]
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(dp, nodes, local), mesh_dim_names=("dp_replicate", "inter",
                                                                                            "intra"))
        block = rng.choice([1, 3, 8, 64, 100])
        n = rng.choice([1, block, block + 1, rng.randrange(1, 700)])
        kind = DISTRIBUTIONS[(seed + li) % len(DISTRIBUTIONS)]
        grads = [values(size * n, block, kind, rng, torch.float32) for _ in range(4)]
        bad = (rng.randrange(4), rng.randrange(size * n), rng.choice(BAD)) if li % 3 == 2 else None
        if bad:
            grads[bad[0]][bad[1]] = bad[2]
        op = rng.choice([dist.ReduceOp.SUM, dist.ReduceOp.AVG])
        out = torch.full((n,), 99.0)
        QuantizedReduceScatter(block, mesh, compiled)(out, grads[rank].clone(), groups[rank // size], op)
        total, headroom, bound = ref_reduce(grads, layout, rank, n, block)
        exact = torch.stack(grads[rank - rank % size:][:size]).double().sum(0).view(size, n)[rank % size]
        if op == dist.ReduceOp.AVG:
            bound, exact = bound / size, exact / size
        want = finish(total, headroom, layout, size, op == dist.ReduceOp.AVG)
        label = f"layout {layout} n {n} block {block} {kind} {op}"
        problems += _reduce_problems(label, out, want, bound, exact, compiled)
        if bad and bad[0] // size == rank // size and bad[1] // n == rank % size:
            if torch.isfinite(out[bad[1] % n]):
                problems.append(f"{label}: a {bad[2]} gradient came out {out[bad[1] % n].item()}")
    return problems


def _reduce_problems(label, out, want, bound, exact, compiled: bool) -> list[str]:
    import torch

    ok = exact.isfinite() & want.isfinite()
    problems = []
    # the eager kernels sum as the reference does (fp32, peer order): the same bits; compiled ones may sum in
    # another order (docs: equal up to it), so within the bound
    if not compiled and not same(out, want):
        problems.append(f"{label}: off the simulated exchanges by {(out - want)[ok].abs().max().item()}")
    slack = 8 * 2.0 ** -23 * (exact.abs() + bound)  # (fp32 sums of up to 4 terms)
    err = (out.double() - exact).abs()
    if not torch.all(err[ok] <= (bound + slack)[ok]):
        problems.append(f"{label}: off the exact sum by {err[ok].max().item()}, more than the rounding allows")
    if not torch.equal(out.isfinite(), want.isfinite()):
        problems.append(f"{label}: non-finite values where the reference has none, or the reverse")
    return problems


STEPS = ["--train.steps=3", "--model.layers=2"]
TRAINING = {"plain": [], "hpz": ["--parallel.zero_pp=hpz"],
            "hpz of 2 in nodes of 4": ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=4",
                                       "--parallel.hpz_ranks=2"],
            "qwz": ["--parallel.zero_pp=qwz", "--parallel.zero_pp_block=37"],
            "hpz,qwz": ["--parallel.zero_pp=hpz,qwz", "--parallel.zero_pp_block=37"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("zeropp_fuzz118")
    jobs = [("gather", _gather_cases, (118,)), ("uneven fsdp", _uneven_fsdp, (118,)), ("reduce", _reduce_cases, (118,))]
    if _has_compiler():  # (compiling costs seconds: a few cases)
        jobs += [("gather compiled", _gather_cases, (218, True)), ("reduce compiled", _reduce_cases, (318, True))]
    jobs += [(name, _losses, ([*STEPS, *args], f"{base}/{i}")) for i, (name, args) in enumerate(TRAINING.items())]
    jobs.append(("partition", _post_forward_groups, ([*STEPS, *TRAINING["hpz of 2 in nodes of 4"]], f"{base}/p")))
    return run_spawned_many(4, jobs)


@pytest.mark.parametrize("job", ["gather", "uneven fsdp", "reduce"])
def test_hooks_match_the_reference(runs, job):
    assert runs[job] == [[]] * 4, runs[job]


@pytest.mark.parametrize("job", ["gather compiled", "reduce compiled"])
@needs_compiler
def test_compiled_hooks_match_the_reference(runs, job):
    assert runs[job] == [[]] * 4, runs[job]


@pytest.mark.parametrize("mode", ["hpz", "hpz of 2 in nodes of 4"])
def test_hpz_trains_as_plain_fsdp(runs, mode):
    for plain, hpz in zip(runs["plain"], runs[mode]):
        assert len(hpz) == 3 and max(abs(a - b) for a, b in zip(plain, hpz)) <= 1e-6, (plain, hpz)


def test_hpz_partition_is_hpz_ranks_and_hpz_with_qwz_rounds_once(runs):
    assert all(sizes and set(sizes) == {2} for sizes in runs["partition"]), runs["partition"]
    for plain, qwz, both in zip(runs["plain"], runs["qwz"], runs["hpz,qwz"]):
        assert max(abs(a - b) for a, b in zip(qwz, both)) <= 1e-6, (qwz, both)
        assert 0 < max(abs(a - b) / a for a, b in zip(plain, qwz)) < 5e-3, (plain, qwz)
