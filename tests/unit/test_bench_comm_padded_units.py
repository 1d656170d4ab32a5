"""bench comm's closed form where the group does not divide a parameter's dim 0 (3 x 2 or 2 x 3 ranks on the
debug model): FSDP2 pads dim 0 to a multiple of the group and hpZ's post-forward copy is a share of that padded
tensor (ceil(d / group) x group / node rows, not ceil(d / node)), and co2's outer all-reduce sends each rank's
unpadded local shard (torch.chunk's: the last ranks' are short), not the padded one. The closed form was
147,840 bytes a step short for hpz on 3 x 2 and 19,492 over for co2 on 2 x 3, against the emulated links'
count (which the docs say it equals exactly)."""

import math

import torch

from longctx.bench.comm_bytes import Unit, step_bytes
from longctx.bench.comm_cluster import units_of
from longctx.parallel.fsdp.grad_buckets import BucketPlan

SHAPES = [(64, 16), (172, 64), (5,)]  # dims 0 that 6 and 3 do not divide


def _model():
    layer = torch.nn.Module()
    for i, shape in enumerate(SHAPES):
        layer.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    model.root = torch.nn.Parameter(torch.zeros(7, 3))
    model.grad_bucket_plan = BucketPlan((1,), "parallel.grad_bucket_blocks", None, None)
    return model


def _rest(shape):
    return math.prod(shape[1:])


def test_hpz_post_forward_copy_is_a_share_of_the_padded_tensor():
    block = units_of(_model(), group=6, node=2)[0]
    # FSDP2: dim 0 padded to a multiple of 6, the gathered tensor cut in 2 after forward (reshard_after_forward=2)
    assert block.node_elements == sum(math.ceil(s[0] / 6) * 6 // 2 * _rest(s) for s in SHAPES)
    assert block.node_elements != sum(math.ceil(s[0] / 2) * _rest(s) for s in SHAPES)  # (what was counted)


def test_co2_local_shards_are_torch_chunks_unpadded():
    units = units_of(_model(), group=3, node=3)
    assert list(units[0].local_elements) == [sum(torch.zeros(s).chunk(3)[r].numel() for s in SHAPES) for r in range(3)]
    # the root's [7, 3]: dim 0 over 3 would pad 7 rows to 9 (1.29x), so FSDP shards its dim 1, one column a rank
    assert units[1].local_elements == (7, 7, 7)
    assert units_of(_model(), group=3, node=3, even=False)[1].local_elements == tuple(
        torch.zeros(7, 3).chunk(3)[r].numel() for r in range(3))  # (under hpz: dim 0, the last rank short)


def test_a_tensor_fsdp_shards_on_dim_1_counts_its_even_share():
    """FSDP2 cuts shard_dim's dim (parallel/fsdp/shard.py even_placement): a [3, 8] tensor over 2 ranks on
    dim 1 (dim 0 would pad 3 rows to 4), 12 elements a rank, no padding; under hpz dim 0, 2 rows of 8."""
    model = _model()
    model.layers[0].p0.data = torch.zeros(3, 8)
    even, hpz = units_of(model, group=2, node=2)[0], units_of(model, group=2, node=2, even=False)[0]
    others = sum(math.ceil(s[0] / 2) * _rest(s) for s in SHAPES[1:])
    assert even.elements == 12 + others
    assert hpz.elements == 16 + others


def test_co2_outer_all_reduce_counts_each_ranks_own_shard():
    nodes, ranks, steps, local = 2, 3, 2, (22, 22, 20)
    padded = step_bytes("co2", [Unit(22, 22)], nodes, ranks, local_steps=steps)["inter_node_bytes"]
    exact = step_bytes("co2", [Unit(22, 22, local_elements=local)], nodes, ranks, local_steps=steps)["inter_node_bytes"]
    # each rank's all-reduce over the 2 replicas sends 2 x 4 s (N - 1) / N bytes, every hop across nodes
    assert padded - exact == nodes * sum(2 * 4 * (22 - s) * (nodes - 1) // nodes for s in local) / steps


def test_where_the_group_divides_every_dim_nothing_changes():
    model = _model()
    for p in model.parameters():
        p.data = torch.zeros(12, *p.shape[1:])
    units = units_of(model, group=6, node=2)
    assert units[0].node_elements == sum(6 * _rest(s) for s in SHAPES)
    assert units[0].local_elements == (sum(2 * _rest(s) for s in SHAPES),) * 6
