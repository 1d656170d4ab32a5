"""The planner's and the metrics line's FSDP bytes where the group does not divide a parameter's dim 0 (3
ranks: the debug model's 128-wide and 320-row tensors, debug-moe's [8, ...] expert tensors): FSDP2 pads each
tensor's dim 0 to a multiple of the group, and its all-gathers and reduce-scatters carry the padding. The
figures were from the unpadded parameter counts: 0.6% low on debug, 8.7% on debug-moe (where a [experts, ...]
tensor over more ranks than experts moves group / experts times its size). Counted by tests/link_audit.py
RawLinks from the c10d operators."""

import pytest

from link_audit import by_op, collective_bytes, layout_config, layout_traffic, planner_bytes
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.planner.validate import build_config

pytestmark = pytest.mark.slow  # one 3-rank job: ~25 s on a 2-core CPU

CASES = {  # name: (preset, seq_len, degrees), on 3 ranks
    "debug dp_shard 3": ("debug", 256, dict(shard=3)),
    "debug-moe dp_shard 3": ("debug-moe", 256, dict(shard=3)),
    "debug ctx 3": ("debug", 384, dict(ctx=3)),
    "debug HSDP 3 x 1": ("debug", 256, dict(rep=3)),
}


@pytest.fixture(scope="module")
def sent():
    raws = [layout_config(p, s, **d) for p, s, d in CASES.values()]
    return dict(zip(CASES, (list(r) for r in zip(*run_spawned(3, layout_traffic, raws)))))


@pytest.mark.parametrize("name", list(CASES))
def test_the_planners_fsdp_bytes_carry_fsdp2s_padding(name, sent):
    preset, seq_len, degrees = CASES[name]
    comm = planner_bytes(layout_config(preset, seq_len, **degrees))
    for rank, got in enumerate(sent[name]):
        ops = by_op(got["raw"])
        rings = ops.get("all_gather", 0) + ops.get("reduce_scatter", 0) + ops.get("all_reduce", 0)
        # (abs 1: job/comm.py, and so the planner, counts an all-reduce's 2 (n - 1) / n in whole bytes)
        assert rings == pytest.approx(collective_bytes(comm), abs=1), (rank, got["raw"], comm)
        assert ops.get("send", 0) == sum(comm.get("ctx", {}).values()), (rank, got["raw"], comm)


def test_debug_moe_over_3_ranks_moves_its_padded_experts(sent):
    """What the ranks sent is (n - 1) / n of the padded tensors per pass: two 4-byte gathers and one fp32
    reduce-scatter of the blocks, one of each of the root; 8% more than the unpadded parameters (the experts'
    [8, ...] tensors are 9 rows over 3 ranks)."""
    from longctx.costs.model_states import fsdp_carried_params

    m = build_config(layout_config("debug-moe", 256, shard=3)).model
    shape = MeshShape(dp_shard=3)
    padded, plain = fsdp_carried_params(m, shape), param_counts(m)
    ops = by_op(sent["debug-moe dp_shard 3"][0]["raw"])
    unpadded = 2 / 3 * 4 * (3 * (plain["total"] - plain["root"]) + 2 * plain["root"])
    extra = 2 / 3 * 4 * (3 * (padded["total"] - padded["root"]) + 2 * padded["root"])
    assert ops["all_gather"] + ops["reduce_scatter"] == pytest.approx(extra, abs=1)
    assert extra / unpadded > 1.08  # the experts' [8, ...] tensors padded to 9 rows over 3 ranks


def test_fsdp_carried_pads_dim_0_to_the_group_and_experts_dim_1_to_their_data_group():
    """By hand: a [5, 4] block weight and a [3] root norm over 4 ranks; an [8, 6, 2] routed expert tensor under
    expert parallelism 2 over 6 ranks (expert-data group 3): 4 rows each, dim 1 already a multiple of 3. The
    [5, 4] weight on dim 0 would pad 5 rows to 8 (1.6x its size), so FSDP cuts its dim 1, which 4 divides
    (costs/model_states.py shard_dim); under hpz (`even` False) dim 0 stays, padded; the [7, 2] weight over 3
    (9 rows, 1.29x) has no other dim 3 divides: dim 0, padded."""
    from longctx.costs.model_states import fsdp_carried

    got = fsdp_carried([((5, 4), False, False), ((3,), False, True)], 4)
    assert got == {"total": 5 * 4 + 4, "root": 4, "experts": 0}
    got = fsdp_carried([((5, 4), False, False), ((3,), False, True)], 4, even=False)
    assert got == {"total": 8 * 4 + 4, "root": 4, "experts": 0}
    got = fsdp_carried([((8, 6, 2), True, False), ((7, 2), False, False)], 3, expert=2, expert_data=3)
    assert got == {"total": 2 * 4 * 6 * 2 + 9 * 2, "root": 0, "experts": 2 * 4 * 6 * 2}
