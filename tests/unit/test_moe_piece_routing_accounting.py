"""A MoE block whose routing looks across tokens (a capacity, the Sinkhorn router in training) and whose call a memory
policy runs in pieces routes the pieces with one decision over the whole call (memory/apply_policy.py _PieceRouting):
its chosen experts (int16) and kept flags stay on the device until the block's backward, and with a capacity the
router's records keep the rows each expert runs as a tensor of their own. Neither was counted: ~1.2 KB per block
under (the device count below the measured bytes) at 192 tokens, growing with the tokens. Now counted
(memory/moe_counts.py piece_routing_bytes, moe_call_bytes): exact under selective and full with a capacity, a few
hundred bytes over with Sinkhorn (its kept flags counted as a bound), in fp32 and under bf16 autocast."""

import pytest
from test_autocast_moe_accounting import BATCH, SEQ, measured_and_counted

ROUTINGS = {"capacity": ["--model.moe.capacity_factor=1.25"],
            "capacity shared": ["--model.moe.capacity_factor=1.25", "--model.moe.shared_experts=1"],
            "sinkhorn": ["--model.moe.router=sinkhorn"]}
# policies that run a block call in more than one piece (block_chunk, or a stored and a recomputed part), and one
# that runs it whole (nothing to hold)
POLICIES = [("selective", 0.5, 0, 0, 0), ("selective", 0.5, 0, 64, 0), ("selective", 0.0, 1, 64, 0),
            ("full", 1.0, 0, 64, 64), ("selective", 1.0, 0, 0, 64)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("recompute,fraction,skip_last,block_chunk,expert_chunk", POLICIES)
def test_routing_held_across_pieces_is_counted(routing, bf16, recompute, fraction, skip_last, block_chunk,
                                               expert_chunk):
    cfg, measured, layers = measured_and_counted(ROUTINGS[routing], recompute, fraction, skip_last, block_chunk,
                                                 expert_chunk, bf16=bf16)
    tokens, k = SEQ * BATCH, cfg.moe_top_k
    for i in cfg.moe_layer_ids:
        got, la = measured[i]["device"], layers[i].device
        assert la >= got, (i, got, la)  # never under
        # over by at most the bounds: Sinkhorn's kept flags (1 B per choice) and its records' rows [E] per piece
        assert la <= got + tokens * k + 4 * cfg.moe_experts * 4, (i, got, la)
