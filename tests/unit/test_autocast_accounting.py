"""One process in bf16 off the `host` tier (and bf16 on CPU) is autocast over fp32 weights, not FSDP's bf16
weights (memory/accounting.py activation_dtype): its residual stream (every block's input and output) stays
fp32 and its saved matmuls keep autocast's bf16 copy of their weight. The count once took such a run for
bf16 activations (dtype_bytes 2): measured here it kept 2.0x the predicted host bytes under full + offload
(the block inputs, fp32) and 13.4x the device bytes under selective + offload (the weight copies), so the
planner's one-GPU plan and the host preflight under-counted them. Now counted at 4 B with the weight
copies: exact under full, never below what is measured, and at most 1.6x over (bf16 matmul outputs)."""

import pytest
import torch
from probes import packed_batch

from longctx.config import load_config
from longctx.memory.accounting import activation_dtype, estimate_activations, layer_activations, measure_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model

SEQ, BATCH = 96, 2


def test_which_runs_compute_over_fp32_weights():
    assert activation_dtype(False, 1, "device") == (4, False)  # fp32: no autocast
    assert activation_dtype(True, 1, "device") == activation_dtype(True, 1, "host_optimizer") == (4, True)
    assert activation_dtype(True, 1, "host") == (2, False)  # a one-rank FSDP job: bf16 weights
    assert activation_dtype(True, 8, "device") == (2, False)
    assert activation_dtype(True, 8, "device", "cpu") == (4, True)  # (FSDP keeps fp32 on CPU)


@pytest.mark.parametrize("recompute,fraction,skip_last", [("full", 1.0, 0), ("full", 0.0, 1), ("selective", 1.0, 0),
                                                          ("selective", 0.0, 1), ("none", 0.0, 1)])
def test_autocast_over_fp32_weights_keeps_no_more_than_counted(recompute, fraction, skip_last):
    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0)  # fp32 weights, as one GPU process of the device tier keeps them
    model.memory_offloader = apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=skip_last)
    model.loss_chunk = 64
    forward = model.forward

    def autocast_forward(*a, **k):  # (the forward under autocast, as step/loss.py runs it; backward outside)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*a, **k)

    model.forward = autocast_forward
    tokens, positions, doc, labels = packed_batch(cfg, seq=SEQ, batch=BATCH)
    measured = measure_activations(model, tokens, positions, doc, labels=labels)
    e, copies = activation_dtype(True, 1, "device")
    policy = MemoryPolicy(recompute, fraction, skip_last, loss_chunk=64)
    est = estimate_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, weight_copies=copies)
    layers = layer_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, weight_copies=copies)
    for got, la in zip(measured["blocks"], layers):  # every block, either tier: never more than counted
        assert got["device"] <= la.device and got["host"] <= la.host, (got, la)
    # (the loss's few scalars aside)
    assert measured["total_device"] <= est.total_device + 64 and measured["total_host"] <= est.total_host
    assert est.total_device <= 1.6 * measured["total_device"] and est.total_host <= 1.6 * measured["total_host"]
    if recompute == "full":  # the one tensor a block keeps, its fp32 input: exact
        assert est.total_device <= measured["total_device"] + 64 and est.total_host == measured["total_host"]
