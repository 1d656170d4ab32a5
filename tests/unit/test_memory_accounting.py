"""The analytic activation count (memory/accounting.py) against a measurement of what each policy
really keeps after the forward, on one process: device and host bytes, every policy including
full + offload and chunked blocks, with the loss chunked (final norm inside it) and not."""

import dataclasses

import pytest
import torch

from longctx.config import load_config
from longctx.memory.accounting import estimate_activations, layer_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model

SEQ = 256
# (policy, offload fraction, block chunk, offload_skip_last)
CASES = [("none", 0.0, 0, 1), ("full", 0.0, 0, 1), ("selective", 0.0, 0, 1), ("selective", 0.5, 0, 1),
         ("full", 1.0, 0, 1), ("full", 0.5, 0, 1), ("selective", 0.0, 64, 1), ("full", 1.0, 64, 1),
         ("selective", 0.5, 96, 1), ("full", 1.0, 64, 0)]


@pytest.mark.parametrize("loss_chunk", [0, 64])
@pytest.mark.parametrize("policy,fraction,chunk,skip_last", CASES)
def test_measured_bytes_equal_the_analytic_count(policy, fraction, chunk, skip_last, loss_chunk):
    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, policy, fraction, offload_skip_last=skip_last,
                                                  block_chunk=chunk)
    model.loss_chunk = loss_chunk
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    measured = measure_activations(model, tokens, labels=tokens)
    est = estimate_activations(cfg, SEQ, 1, policy=MemoryPolicy(policy, fraction, skip_last, loss_chunk=loss_chunk),
                               dtype_bytes=4)
    assert measured["total_device"] == pytest.approx(est.total_device, rel=1e-3)
    assert measured["total_host"] == pytest.approx(est.total_host, rel=1e-3, abs=64)
    if fraction > 0:  # the first block is offloaded: its bytes by tier
        assert measured["blocks"][0]["host"] == pytest.approx(est.per_block_host, rel=1e-3)


def test_full_offload_keeps_the_least_host_memory_of_any_offload():
    """Measured, not restated: full + offload puts exactly the block input on the host (its bytes taken
    from the real input tensor), and far less than selective + offload does."""
    cfg = load_config(overrides=["--model.layers=3"]).model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    host = {}
    for policy, fraction in (("full", 1.0), ("selective", 0.0001)):
        model = build_model(cfg, seed=0)
        model.memory_offloader = apply_memory_policy(model.layers, policy, fraction)
        seen = []
        model.layers[0].register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].nbytes))
        host[policy] = measure_activations(model, tokens, labels=tokens)["blocks"][0]["host"]
        block_input_bytes = seen[0]
    assert host["full"] == block_input_bytes
    assert host["full"] < host["selective"] / 3


# (policy, offload fraction, block chunk, attention offload): the chunked attention core
ATTENTION_CHUNK_CASES = [("none", 0.0, 0, False), ("selective", 0.0, 0, False), ("selective", 0.0, 0, True),
                         ("none", 0.0, 0, True), ("selective", 0.5, 64, True), ("full", 1.0, 64, True),
                         ("selective", 0.5, 0, False)]


@pytest.mark.parametrize("policy,fraction,chunk,attention_offload", ATTENTION_CHUNK_CASES)
def test_chunked_attention_keeps_what_the_analytic_count_says(policy, fraction, chunk, attention_offload):
    """memory.attention_chunk keeps the same q, k, v, out, lse (by chunk); with attention_offload they
    are in host memory (measured: the chunk store's host tier) in every block."""
    from longctx.config import MemoryConfig
    from longctx.parallel.parallelize import apply_memory

    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0)
    memory = MemoryConfig(recompute=policy, offload_fraction=fraction, block_chunk=chunk, loss_chunk=64,
                          attention_chunk=96, attention_offload=attention_offload)
    apply_memory(model, memory, "cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    measured = measure_activations(model, tokens, labels=tokens)
    est = estimate_activations(cfg, SEQ, 1, policy=MemoryPolicy.from_config(memory), dtype_bytes=4)
    assert measured["total_device"] == pytest.approx(est.total_device, rel=1e-3)
    assert measured["total_host"] == pytest.approx(est.total_host, rel=1e-3, abs=64)
    if attention_offload and policy != "full":  # the kept last block: the core state on the host
        assert measured["blocks"][-1]["host"] == pytest.approx(est.per_block_host if not fraction else
                                                               est.total_host - 2 * est.per_block_host, rel=1e-3)
        assert measured["blocks"][-1]["host"] > 0


# ------------------------------------------------------------------------------------------------
# Mixture of Experts: debug-moe's shape (layer 0 dense, moe.dense_layers "0"; layers 1-2 MoE: 8
# experts of 128, top-2 of a softmax, dropless), three blocks. Routing is data dependent, but with
# the top-k choice every token fills exactly k slots, so what a block keeps is not.


def moe_model(**over):
    return load_config(None, {"model": {"preset": "debug-moe", "layers": 3, **over}}).model


def _measure_moe(cfg, policy: MemoryPolicy):
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, policy.recompute, policy.offload_fraction,
                                                  offload_skip_last=policy.offload_skip_last,
                                                  block_chunk=policy.block_chunk)
    model.loss_chunk = policy.loss_chunk
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    return measure_activations(model, tokens, labels=tokens)


@pytest.mark.parametrize("policy,fraction,chunk,skip_last", CASES)
def test_moe_blocks_keep_what_the_analytic_count_says(policy, fraction, chunk, skip_last):
    """Every policy, every block to the byte (the dense block 0 and the MoE blocks 1-2 apart: the
    router's fp32 logits and probabilities, the top-k indices and weights, the permuted tokens, the
    experts' SwiGLU intermediates, the un-permute), device and host; the totals as for dense."""
    cfg = moe_model()
    pol = MemoryPolicy(policy, fraction, skip_last, loss_chunk=64, block_chunk=chunk)
    measured = _measure_moe(cfg, pol)
    layers = layer_activations(cfg, SEQ, 1, policy=pol, dtype_bytes=4)
    assert [la.moe for la in layers] == [False, True, True]
    assert measured["blocks"] == [{"device": la.device, "host": la.host} for la in layers]
    est = estimate_activations(cfg, SEQ, 1, policy=pol, dtype_bytes=4)
    assert measured["total_device"] == pytest.approx(est.total_device, rel=1e-3)
    assert measured["total_host"] == pytest.approx(est.total_host, rel=1e-3, abs=64)
    if policy == "none":  # the MoE feed-forward keeps more than debug's SwiGLU of 384 here
        assert measured["blocks"][1]["device"] > measured["blocks"][0]["device"]


@pytest.mark.parametrize("over", [
    {"moe.shared_experts": 1, "moe.shared_dim": 96, "moe.shared_gate": True},  # shared experts behind a gate
    {"moe.norm_topk": False},                                                # weights not renormalised
    {"moe.router": "switch", "moe.top_k": 1},
    {"moe.router": "sigmoid", "moe.groups": 2, "moe.topk_groups": 1, "moe.route_scale": 2.5},
    {"moe.top_k": 3, "moe.expert_dim": 64},
    {"moe.z_loss": 0.0},  # no z-loss: the router logits are not kept
    {"moe.z_loss": 0.0, "moe.router": "sigmoid"},
])
@pytest.mark.parametrize("policy", [MemoryPolicy("none"), MemoryPolicy("selective", 0.5, 1, loss_chunk=64)])
def test_moe_variants_keep_what_the_analytic_count_says(over, policy):
    """The router and feed-forward variants change what a MoE block keeps: still to the byte, on the
    device (none) and in its stored half on the host (selective + offload)."""
    cfg = moe_model(**over)
    measured = _measure_moe(cfg, policy)
    layers = layer_activations(cfg, SEQ, 1, policy=policy, dtype_bytes=4)
    assert measured["blocks"] == [{"device": la.device, "host": la.host} for la in layers]


@pytest.mark.parametrize("policy,fraction,chunk", [("none", 0.0, 0), ("selective", 0.5, 96), ("full", 1.0, 64),
                                                   ("selective", 0.0, 0)])
def test_moe_expert_chunk_keeps_what_the_analytic_count_says(policy, fraction, chunk):
    """memory.expert_chunk (set through apply_memory, as training does): a call of more routed rows
    than the chunk keeps no expert intermediates, only each piece's group counts; calls of fewer
    rows (a 64-token block chunk routes 128) are not cut. To the byte, block by block."""
    from longctx.config import MemoryConfig
    from longctx.parallel.parallelize import apply_memory

    cfg = moe_model()
    memory = MemoryConfig(recompute=policy, offload_fraction=fraction, block_chunk=chunk, loss_chunk=64,
                          expert_chunk=100)
    model = build_model(cfg, seed=0)
    apply_memory(model, memory, "cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    measured = measure_activations(model, tokens, labels=tokens)
    pol = MemoryPolicy.from_config(memory)
    layers = layer_activations(cfg, SEQ, 1, policy=pol, dtype_bytes=4)
    assert measured["blocks"] == [{"device": la.device, "host": la.host} for la in layers]
    whole = layer_activations(cfg, SEQ, 1, policy=dataclasses.replace(pol, expert_chunk=0), dtype_bytes=4)
    if policy == "none":  # 512 routed rows in pieces of 100: the experts' 4 x 128 fp32 per row are not kept,
        # nor the grouped GEMM kernel's int32 offsets (3 x [8], where it runs); each piece's counts are
        from longctx.ops.grouped import cpu_kernel_available

        offsets = 3 * 8 * 4 if cpu_kernel_available() else 0
        assert whole[1].device - layers[1].device == 512 * 4 * 128 * 4 + offsets - 6 * 8 * 8
    # every cut call runs its experts' w1 and w3 once more in backward (not w2: the recomputation stops at its
    # saved inputs, tests/unit/test_flops_audit2_recompute.py): all 512 rows, but under
    # selective + offload with 96-token pieces only the 192-row calls (the 32-token ones route 64)
    cut_rows = 384 if chunk == 96 else 512
    assert layers[1].recompute_flops - whole[1].recompute_flops == cut_rows * 4 * 128 * 128
