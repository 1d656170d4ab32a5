"""The planner's FSDP bytes and seconds carry the tensors as FSDP2 cuts and pads them. debug-moe over 16 ranks:
its routed experts are [8, 128, 128] tensors (w1, w3, w2) and its router [8, 128]. On dim 0, 8 rows over 16 ranks
would give every rank one row (ranks 8-15 a row of padding) and gather 16: twice the tensors; FSDP cuts them on
dim 1 instead (costs/model_states.py shard_dim), which 16 divides, so they carry their parameters. Under hpz
(FSDP2 reshards to the node for dim 0's layout only) they stay on dim 0, padded. Every other dim divides 16.
By hand, a MoE block: norms 2 x 128, wq and wo 128 x 128 each, wk and wv 64 x 128 each, router 8 x 128, experts
3 x 8 x 128 x 128 = 443,648 parameters; padded on dim 0 (router 16 x 128, experts 3 x 16 x 128 x 128) 837,888
elements carried; the dense block 0: 196,864; the root (embeddings and LM head 320 x 128, norm 128): 82,048.
Before, the planner counted the parameters whatever the padding (0.57 of what the ranks sent on debug-moe under
dim 0's padding; mixtral-8x7b over 64 ranks: 0.13)."""

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.model_states import fsdp_carried_blocks
from longctx.costs.shape import MeshShape
from longctx.costs.timing import _fsdp_units, fsdp_transfer_seconds
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import estimate

MOE = load_config(None, ["--model.preset=debug-moe"]).model
SHAPE = MeshShape(dp_shard=16)
MOE_BLOCK, PADDED_MOE_BLOCK, DENSE_BLOCK, ROOT = 443_648, 837_888, 196_864, 82_048


def test_the_planners_fsdp_bytes_carry_the_experts_as_fsdp_cuts_them():
    hw = PRESETS["h100"]  # bf16 gathers (2 bytes), fp32 gradients
    est = estimate(MOE, hw, SHAPE, MemoryPolicy(), seq_len=256, global_batch=16, micro_batch=1, gpus_per_node=16)
    blocks = DENSE_BLOCK + 3 * MOE_BLOCK
    gathers = 15 / 16 * (2 * blocks + ROOT) * 2  # every block forward and backward, the root once
    reduces = 15 / 16 * (blocks + ROOT) * 4
    assert est.comm_bytes["fsdp"]["fsdp"] == gathers + reduces


def test_under_hpz_the_experts_carry_dim_0s_padding():
    blocks, root = fsdp_carried_blocks(MOE, MeshShape(dp_shard=16, zero_pp="hpz", node=8))
    assert blocks == ((DENSE_BLOCK, 0),) + ((PADDED_MOE_BLOCK, 0),) * 3 and root == ROOT
    assert fsdp_carried_blocks(MOE, SHAPE) == (((DENSE_BLOCK, 0),) + ((MOE_BLOCK, 0),) * 3, ROOT)


def test_the_planners_fsdp_seconds_carry_the_experts_as_fsdp_cuts_them():
    hw = PRESETS["h100"]
    _, units = _fsdp_units(MOE, SHAPE, 2, hw, 16)
    moe = fsdp_transfer_seconds(MOE, SHAPE, 2, hw, 16, block=MOE_BLOCK)  # (the root: no padding)
    dense = fsdp_transfer_seconds(MOE, SHAPE, 2, hw, 16, block=DENSE_BLOCK)
    assert sorted(units) == sorted([(3, moe["block_gather"], moe["block_gather_bwd"], moe["block_reduce"]),
                                    (1, dense["block_gather"], dense["block_gather_bwd"], dense["block_reduce"])])
