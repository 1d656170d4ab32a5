"""A DTS-Gate run's memory counts bound every step of its schedule, not only step 0 (memory/peak_routing.py).

At step 0 every expert is routed, so under expert parallelism every rank receives all its tokens' rows and no
receive skew is possible; the steps that route fewer experts per token can skew, and the most loaded rank then
holds extra received rows (expert_skew_transient_bytes), and with shared experts their overlap with the return
transfer is beyond the feed-forward's count (shared_overlap_transient_bytes). Counted at step 0 (E) alone, the
planner's rank total of a DTS model came out below what the same run holds once the schedule routes top_k (E 8,
top_k 1 under expert 4 at skew 1.5: 0.74x), below even what the count was at top_k before DTS was counted at E.

What a step routing k experts per token holds is counted here as the same model with a router that routes k every
step (softmax, top_k k): the counts the other routers are held to (tests/unit/test_plancount_fuzz117.py)."""

import pytest

from longctx.config import ModelConfig
from longctx.costs.host_bytes import predicted_rank_bytes
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner.activation_costs import rank_activations

SHARED = {"moe_shared_experts": 1, "moe_shared_dim": 16, "moe_shared_gate": True}
CASES = [  # (model keys, policy, expert, ranks_per_node, replicas, seq_len, head, dtype_bytes, skew)
    ({"dim": 32, "moe_experts": 8, "moe_top_k": 1, "moe_expert_dim": 80}, {"recompute": "full", "block_chunk": 24},
     4, 0, 0, 64, 1, 4, 1.5),
    ({"dim": 16, "moe_experts": 8, "moe_top_k": 2, "moe_expert_dim": 80, **SHARED},
     {"recompute": "full", "offload_fraction": 1.0, "offload_skip_last": 0, "expert_chunk": 16}, 4, 2, 0, 128, 2, 2,
     3.0),
    ({"dim": 32, "moe_experts": 2, "moe_top_k": 1, "moe_expert_dim": 24, "moe_z_loss": 1e-3, **SHARED},
     {"recompute": "full", "offload_fraction": 0.5}, 2, 0, 1, 128, 2, 2, 1.5),
]


def _model(keys: dict, router: str, **more) -> ModelConfig:
    return ModelConfig(**{"layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 32, "vocab_size": 500, **keys,
                          "moe_router": router, **more})


def _rank_total(m: ModelConfig, policy: MemoryPolicy, shape: MeshShape, seq: int, db: int, skew: float) -> float:
    acts, transient = rank_activations(m, seq, 1, shape, policy, db, True, skew)
    return acts.total_device + transient


@pytest.mark.parametrize("keys,memory,expert,rpn,replicas,seq,head,db,skew", CASES)
def test_dts_rank_total_covers_every_step_of_its_schedule(keys, memory, expert, rpn, replicas, seq, head, db, skew):
    policy = MemoryPolicy(**memory)
    shape = MeshShape(head=head, expert=expert, dp_shard=expert, expert_replicas=replicas,
                      expert_ranks_per_node=rpn)
    dts = _model(keys, "dts", moe_dts_steps=100)
    counted = _rank_total(dts, policy, shape, seq, db, skew)
    device = predicted_rank_bytes(dts, shape, policy, "device", seq_len=seq, micro_batch=1, grad_accum=1,
                                  dtype_bytes=db)[0]["total"]
    for k in range(keys["moe_top_k"], keys["moe_experts"] + 1):
        at_k = _model({**keys, "moe_top_k": k}, "softmax")
        held = _rank_total(at_k, policy, shape, seq, db, skew)
        assert counted >= held, f"k {k}: a step routing {k} holds {held:,.0f} B, the DTS run counted {counted:,.0f}"
        held_device = predicted_rank_bytes(at_k, shape, policy, "device", seq_len=seq, micro_batch=1, grad_accum=1,
                                           dtype_bytes=db)[0]["total"]
        assert device >= held_device, f"k {k}: predicted_rank_bytes {device:,.0f} B below {held_device:,.0f}"


def test_a_model_without_a_schedule_is_counted_at_top_k_alone():
    """No schedule (another router, or dts_steps 0): the count is the model's own, not a largest over any k."""
    keys, memory, expert, rpn, replicas, seq, head, db, skew = CASES[0]
    policy, shape = MemoryPolicy(**memory), MeshShape(head=head, expert=expert, dp_shard=expert)
    plain = _rank_total(_model(keys, "softmax"), policy, shape, seq, db, skew)
    no_schedule = _rank_total(_model(keys, "dts", moe_dts_steps=0), policy, shape, seq, db, skew)
    wider = _rank_total(_model({**keys, "moe_top_k": 2}, "softmax"), policy, shape, seq, db, skew)
    assert no_schedule == plain and wider != plain


def test_each_expert_parallel_transient_covers_the_schedule():
    """The skewed rank's extra rows, the shared experts' overlap and hierarchical dispatch's stages, each at least
    a step routing k's (E 16, top_k 2, 4 expert ranks of 2 per node, skew 3: hierarchical 28,075 B counted at E
    against 33,470 at a later step)."""
    from longctx.memory.expert_transients import expert_skew_transient_bytes, shared_overlap_transient_bytes
    from longctx.memory.hier_transients import hier_transient_bytes

    keys = {"dim": 32, "moe_experts": 16, "moe_top_k": 2, "moe_expert_dim": 8, "moe_shared_experts": 1,
            "moe_shared_dim": 8}
    policy = MemoryPolicy(recompute="full", block_chunk=16, expert_chunk=100)
    terms = {"skew": lambda m: expert_skew_transient_bytes(m, 128, 4, 3.0, policy, 4),
             "overlap": lambda m: shared_overlap_transient_bytes(m, 128, 4, policy, 4),
             "hierarchical": lambda m: hier_transient_bytes(m, 128, 4, 2, policy, 4, 3.0)}
    dts = _model(keys, "dts", moe_dts_steps=50)
    below = []
    for name, term in terms.items():
        held = max(term(_model({**keys, "moe_top_k": k}, "softmax")) for k in range(2, 17))
        below += [f"{name}: counted {term(dts):,.0f} B, a step holds {held:,.0f}"] if term(dts) < held else []
    assert not below, "; ".join(below)
