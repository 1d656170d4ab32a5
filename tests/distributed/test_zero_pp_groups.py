"""qgZ (parallel/fsdp/quantized.py QuantizedReduceScatter) is installed on every FSDP unit, the experts'
too, and must reduce only the FSDP group it was built for. An expert unit's expert-data group (ranks
at a stride) has the FSDP group's size when parallel.expert = dp_replicate (4 ranks: expert 2 x
dp_replicate 2, both groups of 2), so the group's size cannot tell them apart: such a group gets FSDP's
own reduce-scatter, exact, and the FSDP group still gets the int8 one.

qwZ leaves hpz's backward gathers (within its secondary partition) exact, and tells them by their group
being no larger than the partition. A partition as large as the whole FSDP group (one node; co2 with a
replica per node) is no partition: every gather is then the FSDP group's, and must still be int8.
A unit whose parameters differ in dtype is gathered by FSDP2 as raw bytes (uint8): those are sent as
they are, not quantised as if they were values."""

import pytest

from longctx.job.spawn import run_spawned_many


def _reduce_on_both_groups():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from longctx.job import comm
    from longctx.parallel.fsdp.quantized import QuantizedReduceScatter

    rank = dist.get_rank()
    # dp_replicate 2 x (1 node of 2 ranks): the FSDP groups are {0, 1} and {2, 3}
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 1, 2), mesh_dim_names=("dp_replicate", "inter", "intra"))
    reduce = QuantizedReduceScatter(8, mesh)
    expert_data = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    fsdp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    out = {}
    for name, group in (("expert_data", expert_data), ("fsdp", fsdp)):
        every = {r: torch.randn(2 * 24, generator=torch.Generator().manual_seed(r)) for r in range(4)}
        members = dist.get_process_group_ranks(group)
        exact = sum(every[r] for r in members).view(2, 24)[members.index(rank)]
        got = torch.empty(24)
        comm.reset_counters()
        reduce(got, every[rank].clone(), group, dist.ReduceOp.SUM)
        sent = sum(sum(v.values()) for v in comm.counters().values())
        # within the node each of the 2 summands is rounded by at most half an int8 step of its block
        bound = 2 * max(every[r].abs().max().item() for r in members) / 254
        out[name] = ((got - exact).abs().max().item(), bound, sent)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_spawned_many(4, [("reduce", _reduce_on_both_groups, ()), ("hpz 4", _gather_under_hpz, (4,)),
                                ("hpz 2", _gather_under_hpz, (2,)), ("bytes", _gather_bytes, ()),
                                    ("expert hpz", _expert_gather_under_hpz, ())])


def test_qgz_reduces_an_expert_group_of_the_fsdp_groups_size_over_its_own_ranks(runs):
    for rank in runs["reduce"]:
        err, bound, sent = rank["expert_data"]
        assert err <= 1e-6, f"the expert-data group's gradients were summed over other ranks: off by {err}"
        assert sent == 0  # FSDP's own reduce-scatter (not job/comm.py's int8 all-to-all)
        err, bound, sent = rank["fsdp"]
        assert 0 < err <= bound and sent > 0  # the FSDP group's: int8, within its rounding


def _unit_class():
    """A stand-in FSDP unit: a parameter, and the custom all-gather it is given."""
    import torch

    class Unit(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n))

        def set_custom_all_gather(self, comm):
            self.gather = comm

    return Unit


def _gather_under_hpz(ranks_per_node):
    import types

    import torch
    import torch.distributed as dist

    from longctx.config import load_config
    from longctx.parallel.fsdp.shard import quantize_gathers

    cfg = load_config(None, ["--parallel.zero_pp=hpz,qwz", f"--parallel.ranks_per_node={ranks_per_node}",
                             "--parallel.zero_pp_block=64"])
    Unit = _unit_class()
    comm = quantize_gathers([Unit(4096), Unit(4096)], cfg, types.SimpleNamespace(world_size=4, dp_replicate=1))
    out = torch.empty(4 * 256)
    comm(out, torch.randn(256, generator=torch.Generator().manual_seed(dist.get_rank())), dist.group.WORLD)
    return comm.sent_bytes, comm.plain_bytes


def _expert_gather_under_hpz():
    """quantize_gathers with an expert unit whose expert-data group (2 ranks) is as large as hpz's
    partition (nodes of 2): the dense unit's gather over that partition is hpz's (exact), the expert
    unit's over its group is int8 (before: both exact, qwz silently off for the experts)."""
    import types

    import torch
    import torch.distributed as dist

    from longctx.config import load_config
    from longctx.parallel.fsdp.shard import quantize_gathers

    cfg = load_config(None, ["--parallel.zero_pp=hpz,qwz", "--parallel.ranks_per_node=2",
                             "--parallel.zero_pp_block=64"])
    Unit = _unit_class()
    dense, expert = Unit(4096), Unit(4096)
    quantize_gathers([dense, Unit(4096)], cfg, types.SimpleNamespace(world_size=4, dp_replicate=1, expert=2), False,
                     [expert])
    rank = dist.get_rank()
    pair = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # an expert-data group of 2
    out = []
    for unit in (dense, expert):
        before = unit.gather.sent_bytes
        unit.gather(torch.empty(2 * 256), torch.randn(256, generator=torch.Generator().manual_seed(rank)), pair)
        out.append(unit.gather.sent_bytes - before)
    return out


def test_qwz_quantises_the_expert_units_gathers_under_hpz(runs):
    for dense, expert in runs["expert hpz"]:
        assert dense == 4 * 256 and expert == 256 + 4 * 4, (dense, expert)


def test_qwz_quantises_the_fsdp_groups_gathers_when_hpz_spans_it(runs):
    for nodes_of in (4, 2):  # hpz over the whole group of 4 (no partition), and over nodes of 2
        for sent, plain in runs[f"hpz {nodes_of}"]:
            assert sent == 256 + 4 * 4 < plain == 4 * 256, (nodes_of, sent, plain)


def _gather_bytes():
    import torch
    import torch.distributed as dist

    from longctx.parallel.fsdp.quantized import QuantizedAllGather

    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(64) + rank, torch.randn(64).bfloat16()
    shard = torch.cat([a.view(torch.uint8), b.view(torch.uint8)])  # FSDP2's all-gather input for mixed dtypes
    out = torch.empty(world * shard.numel(), dtype=torch.uint8)
    QuantizedAllGather(64)(out, shard, dist.group.WORLD)
    every = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(every, shard)
    return torch.equal(out, torch.cat(every))


def test_qwz_sends_a_mixed_dtype_units_bytes_as_they_are(runs):
    assert runs["bytes"] == [True] * 4
