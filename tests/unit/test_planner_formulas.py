"""The planner's formulas one at a time, against values worked out by hand for a tiny model.

TINY: dim 8, 2 layers, 2 query heads and 1 kv head of 4 dims, MLP width 16, vocabulary 10, untied
embeddings. Per block: wq [8x8] 64, wk [8x4] 32, wv [8x4] 32, wo [8x8] 64, w1 and w3 [8x16] 128
each, w2 [16x8] 128, two norms of 8 = 592 parameters. Root: embeddings [10x8] 80, final norm 8,
LM head [8x10] 80 = 168. Total 2 x 592 + 168 = 1352.
"""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.model_states import (
    accumulated_grad_bytes,
    gathered_param_bytes,
    param_counts,
    predicted_model_state_bytes,
)
from longctx.costs.shape import MeshShape
from longctx.costs.timing import (
    Flops,
    causal_attention_flops,
    compute_seconds,
    exposed_offload_seconds,
    forward_gemm_flops,
)
from longctx.memory.accounting import ActivationEstimate
from longctx.memory.policy import MemoryPolicy
from longctx.parallel.context.volumes import fsdp_bytes_per_step
from longctx.planner.cost import estimate

TINY = load_config(None, {"model": {"preset": "debug", "dim": 8, "layers": 2, "heads": 2, "kv_heads": 1,
                                    "head_dim": 4, "ffn_dim": 16, "vocab_size": 10,
                                    "tie_embeddings": False}}).model
DP2_CTX2 = MeshShape(dp_shard=2, ctx=2)           # FSDP over 4 ranks
REP2_DP2_CTX2 = MeshShape(2, 2, 1, 2)              # the same, replicated twice (HSDP)
# link speeds in GB/s chosen so that bytes / bandwidth are round seconds: 1e-6 GB/s = 1000 B/s
SLOW = PRESETS["h100"].replace(comm_overlap=0.0, intra_gbps=1e-6, inter_gbps=1e-6, host_link_gbps=1e-6)


def test_parameter_counts():
    assert param_counts(TINY) == {"block": 592, "root": 168, "total": 1352, "experts": 0}


def test_model_states_are_16_bytes_per_parameter_over_the_fsdp_group():
    # fp32 parameter, gradient, exp_avg, exp_avg_sq over dp_shard 2 x ctx 2 = 4 ranks; FSDP2 pads the
    # embeddings' and LM head's 10 rows to 12 (3 a rank): 2 rows x dim 8 x 2 tensors more than 1352
    assert predicted_model_state_bytes(TINY, DP2_CTX2) == (1352 + 2 * 8 * 2) * 16 / 4 == 5536
    assert predicted_model_state_bytes(TINY, REP2_DP2_CTX2) == 5536  # replicas hold the same shard
    assert predicted_model_state_bytes(TINY, MeshShape()) == 1352 * 16


def test_gathered_parameters():
    # bf16 gathers: this block and the prefetched next (2 x 592 x 2 B), one block's fp32 gradient
    # before its reduce-scatter (592 x 4 B), the root gathered (168 x 2 B) with its fp32 gradient (168 x 4 B)
    assert gathered_param_bytes(TINY, DP2_CTX2, 2) == 2368 + 2368 + 336 + 672 == 5744
    assert gathered_param_bytes(TINY, MeshShape(), 2) == 0  # one rank: nothing is sharded


def test_accumulated_gradients_only_when_sync_waits_for_the_step():
    assert accumulated_grad_bytes(TINY, DP2_CTX2, 2, "step") == 1352 * 4  # every gradient, fp32, unsharded
    assert accumulated_grad_bytes(TINY, DP2_CTX2, 2, "micro_batch") == 0
    # an FSDP group of one rank reduces every micro-batch (step/gradients.py): world 1, co2 replicas of one rank
    alone = MeshShape(dp_replicate=2, data_parallel="co2", local_steps=2)
    assert alone.reduces_alone and not MeshShape(dp_replicate=2).reduces_alone
    assert accumulated_grad_bytes(TINY, alone, 2, "step") == 0 < accumulated_grad_bytes(TINY, MeshShape(2), 2, "step")
    assert accumulated_grad_bytes(TINY, DP2_CTX2, 1, "step") == 0
    assert accumulated_grad_bytes(TINY, MeshShape(), 2, "step") == 0


def test_fsdp_bytes_per_step():
    """Per micro-batch each block is gathered for forward and backward, the root once: 2 x 2 x 592 +
    168 = 2536 elements, bf16, 3/4 of each gather sent by a rank of 4 = 3804 B; fp32 gradients
    reduce-scattered once per step: 3/4 x 1352 x 4 = 4056 B. HSDP adds the all-reduce of the
    shard (1352 x 4 / 4 = 1352 B) over 2 replicas, 2 x 1/2 of it."""
    total, root = 1352, 168
    assert fsdp_bytes_per_step(total, root, DP2_CTX2, 2, 2) == {"fsdp": 2 * 3804 + 4056}
    assert fsdp_bytes_per_step(total, root, DP2_CTX2, 2, 2, "micro_batch") == {"fsdp": 2 * 3804 + 2 * 4056}
    assert fsdp_bytes_per_step(total, root, REP2_DP2_CTX2, 2, 2) == {"fsdp": 2 * 3804 + 4056 + 1352}
    # train.data_parallel = co2: the replicas' all-reduce is not in the step (CO2's runs once a round)
    assert fsdp_bytes_per_step(total, root, REP2_DP2_CTX2, 2, 2, replicas_sync=False) == {"fsdp": 2 * 3804 + 4056}
    assert fsdp_bytes_per_step(total, root, MeshShape(), 2, 2) == {}
    # the planner reports the same function's figure, of the tensors as FSDP2 pads them over 4 ranks: the
    # embeddings' and the LM head's 10 rows become 12, a root of 96 + 8 + 96 = 200 (every block dim divides):
    # gathers 2 x 2 x 592 + 200 = 2568 elements, 3/4 x 2 B each = 3852 B per micro-batch; 3/4 x 1384 x 4 = 4152
    est = estimate(TINY, PRESETS["h100"], DP2_CTX2, MemoryPolicy(), seq_len=64, global_batch=4, micro_batch=1)
    assert est.grad_accum == 2 and est.comm_bytes["fsdp"] == {"fsdp": 2 * 3852 + 4152}


def test_forward_flops():
    # 2 FLOPs per matmul parameter and token: 2 layers x 576 matmul parameters + the LM head's 80
    assert forward_gemm_flops(TINY, 16) == 16 * 2 * (2 * 576 + 80) == 39424
    # QK^T and PV over 16 keys: 2 x 2 x 16 x 4 FLOPs per head, token and layer; 2 heads, 2 layers;
    # the causal mask halves it
    assert causal_attention_flops(TINY, 16, 16) == 16 * (2 * 2 * 16 * 4) * 2 * 2 / 2 == 8192


def test_compute_time():
    """Forward + backward (twice the forward) + recomputation, at the efficiency of each kind."""
    hw = PRESETS["h100"].replace(peak_tflops=1.0, gemm_efficiency=0.5, attention_efficiency=0.25)
    f = Flops(gemm_fwd=1e12, causal_attn=0.5e12, attn_fwd=0.5e12, rec_gemm=0.25e12, rec_attn=0.0)
    # GEMMs: 3.25e12 FLOPs at 0.5e12 FLOP/s = 6.5 s; attention: 1.5e12 at 0.25e12 FLOP/s = 6 s
    assert compute_seconds(f, hw) == pytest.approx(12.5)


def test_exposed_ring_hops_without_overlap():
    """ctx 2, 16 tokens, bf16: a layer's forward hop is the other rank's K and V block (8 tokens x
    1 kv head x 4 dims x 2 tensors x 2 B = 128 B); backward the block again and its fp32 dK, dV
    (256 B). 2 layers: 1024 B at 1000 B/s; full recomputation runs the forward hop again."""
    kw = dict(seq_len=16, global_batch=1, micro_batch=1, doc_mask=False)
    none = estimate(TINY, SLOW, MeshShape(ctx=2), MemoryPolicy(), **kw)
    assert none.times["exposed_ctx"] == pytest.approx(1.024)
    full = estimate(TINY, SLOW, MeshShape(ctx=2), MemoryPolicy("full"), **kw)
    assert full.times["exposed_ctx"] == pytest.approx(1.28)
    assert none.times["exposed_head"] == 0


def test_exposed_all_to_all():
    """head 2, 16 tokens, bf16: per rank 8 tokens of q (2 heads x 4 dims), k and v (the one kv head
    replicated to 2) and the output back, 128 B each, half of each sent: 256 B per layer forward,
    as much in backward; 2 layers: 1024 B over a link of 1000 B/s at half efficiency."""
    hw = SLOW.replace(all_to_all_efficiency=0.5)
    est = estimate(TINY, hw, MeshShape(head=2), MemoryPolicy(), seq_len=16, global_batch=1, doc_mask=False)
    assert est.times["exposed_head"] == pytest.approx(2.048)
    assert est.times["exposed_ctx"] == 0


def test_exposed_offload_copies():
    """2 layers, the last kept: one block's 1000 B host tier goes out in its forward and comes back
    in its backward (twice the forward's time to hide behind)."""
    acts = ActivationEstimate(per_block_device=0.0, per_block_host=1000.0, kept_block_device=0.0, model_device=0.0,
                              total_device=0.0, total_host=1000.0, recompute_flops=0.0, tokens=1)
    policy = MemoryPolicy("selective", 1.0, offload_skip_last=1)
    assert exposed_offload_seconds(TINY, policy, acts, 0.5, SLOW) == pytest.approx(2.0)  # 1 s out, 1 s back
    overlapped = SLOW.replace(comm_overlap=1.0)
    assert exposed_offload_seconds(TINY, policy, acts, 0.5, overlapped) == pytest.approx(0.5)  # 1 s vs 0.5 s


def test_mesh_shape():
    shape = MeshShape(2, 2, 2, 4, 2, "ctx-first")
    assert (shape.world, shape.dp, shape.fsdp, shape.sequence_degree) == (32, 4, 16, 8)
    assert shape.describe() == "rep2xdp2xhead2xctx4/w2 cf"
    assert MeshShape().describe() == "single"
