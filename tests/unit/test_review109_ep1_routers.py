"""A MoE model's bytes per link level at expert degree 1 where the blocks gather bf16: FSDP makes each router a
unit of its own gathered in fp32 at any expert degree (parallel/fsdp/shard.py: `mp.param_dtype is not None`, not
only under expert parallelism), but planner/slow_links.py link_level_bytes counted the routers inside the bf16
block units at ep1 (debug-moe on 2 nodes of 4: 21,504 B across nodes and 64,512 B inside them short per step)."""

from longctx.config import load_config
from longctx.costs.hardware import load_hardware
from longctx.costs.link_bytes import layout_bytes
from longctx.costs.shape import MeshShape
from longctx.planner.slow_links import link_level_bytes, planner_units

MODEL = load_config(None, ["--model.preset=debug-moe"]).model  # 3 routers [8, 128]
HW = load_hardware("h100", [], world=8)  # bf16 gathers


def test_ep1_routers_are_gathered_in_fp32_as_under_expert_parallelism():
    got = link_level_bytes(MODEL, MeshShape(dp_shard=8), HW, 4)
    # the blocks (dense parts and, at ep1, the routed experts) in bf16, as layout_bytes counts them with the loss
    blocks = layout_bytes("fsdp", planner_units(MODEL, 8, 4, parts=("dense", "experts")), 2, 4, 1, gather_bytes=2)
    # each router's own unit: [8, 128] over 8 ranks = 128 elements a rank, gathered twice and reduce-scattered in
    # fp32, 7 sends a rank per collective; ranks placed node by node: 2 of a ring's 8 hops cross nodes
    router = 3 * (2 * 4 + 4) * 128 * 7
    # the router statistics' all-reduce: 3 x 3 x 8 + 2 x 3 + 1 = 79 fp32, 2 x 316 x 7 // 8 = 553 B a rank
    assert got["inter_node_bytes"] == blocks["inter_node_bytes"] + 2 * router + 2 * 553
    assert got["intra_node_bytes"] == blocks["intra_node_bytes"] + 6 * router + 6 * 553


def test_fp32_gathers_keep_the_routers_in_their_blocks():
    """On a device that gathers fp32 (no mixed precision) the routers stay in the block units: as before."""
    fp32 = load_hardware("cpu", [], world=8)
    assert fp32.dtype_bytes == 4
    got = link_level_bytes(MODEL, MeshShape(dp_shard=8), fp32, 4)
    blocks = layout_bytes("fsdp", planner_units(MODEL, 8, 4), 2, 4, 1, gather_bytes=4)
    assert got["inter_node_bytes"] == blocks["inter_node_bytes"] + 2 * 553
    assert got["intra_node_bytes"] == blocks["intra_node_bytes"] + 6 * 553


def test_co2_keeps_the_routers_in_the_units_its_outer_all_reduce_counts():
    """co2 replicas (expert 1): the routers' units are not HSDP's per-step all-reduce; they stay in the blocks'."""
    shape = MeshShape(dp_replicate=2, dp_shard=4, data_parallel="co2", local_steps=4)
    got = link_level_bytes(MODEL, shape, HW, 4)
    blocks = layout_bytes("co2", planner_units(MODEL, 4, 4), 2, 4, 2, local_steps=4, gather_bytes=2)
    assert got["inter_node_bytes"] == blocks["inter_node_bytes"] + 2 * 553
