"""One process in bf16 off the `host` tier (and bf16 on CPU) is autocast over fp32 weights, not FSDP's bf16
weights (memory/accounting.py activation_dtype): its residual stream (every block's input and output) stays
fp32 and its saved matmuls keep autocast's bf16 copy of their weight. The count once took such a run for
bf16 activations (dtype_bytes 2): measured here it kept 2.0x the predicted host bytes under full + offload
(the block inputs, fp32) and 13.4x the device bytes under selective + offload (the weight copies), so the
planner's one-GPU plan and the host preflight under-counted them. Then counted at 4 B with the weight
copies: exact under full, never below what is measured, and up to 1.5x over (bf16 matmul outputs: selective
1.49 device and 1.50 host, none 1.38). Now each tensor at its dtype (block_part_bytes `autocast`: the matmul and
attention outputs bf16, a norm's bf16 casts for each matmul it feeds): selective 1.00 device and 1.04 host,
none 1.03, full still exact (2026-12-04)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.config import load_config
from longctx.memory.accounting import activation_dtype, estimate_activations, layer_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from probes import packed_batch

SEQ, BATCH = 96, 2


def test_which_runs_compute_over_fp32_weights():
    assert activation_dtype(False, 1, "device") == (4, False)  # fp32: no autocast
    assert activation_dtype(True, 1, "device") == activation_dtype(True, 1, "host_optimizer") == (4, True)
    assert activation_dtype(True, 1, "host") == (2, False)  # a one-rank FSDP job: bf16 weights
    assert activation_dtype(True, 8, "device") == (2, False)
    assert activation_dtype(True, 8, "device", "cpu") == (4, True)  # (FSDP keeps fp32 on CPU)


def under_autocast(model) -> None:
    """The model's forward under CPU bf16 autocast, as step/loss.py runs it (backward outside)."""
    forward = model.forward

    def autocast_forward(*a, **k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*a, **k)

    model.forward = autocast_forward


@pytest.mark.parametrize("recompute,fraction,skip_last", [("full", 1.0, 0), ("full", 0.0, 1), ("selective", 1.0, 0),
                                                          ("selective", 0.0, 1), ("none", 0.0, 1)])
def test_autocast_over_fp32_weights_keeps_no_more_than_counted(recompute, fraction, skip_last):
    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0)  # fp32 weights, as one GPU process of the device tier keeps them
    model.memory_offloader = apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=skip_last)
    model.loss_chunk = 64
    under_autocast(model)
    tokens, positions, doc, labels = packed_batch(cfg, seq=SEQ, batch=BATCH)
    measured = measure_activations(model, tokens, positions, doc, labels=labels)
    e, copies = activation_dtype(True, 1, "device")
    policy = MemoryPolicy(recompute, fraction, skip_last, loss_chunk=64)
    est = estimate_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, autocast=copies)
    layers = layer_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, autocast=copies)
    for got, la in zip(measured["blocks"], layers):  # every block, either tier: never more than counted
        assert got["device"] <= la.device and got["host"] <= la.host, (got, la)
    # (the loss's few scalars aside)
    assert measured["total_device"] <= est.total_device + 64 and measured["total_host"] <= est.total_host
    assert est.total_device <= 1.1 * measured["total_device"] and est.total_host <= 1.1 * measured["total_host"]
    if recompute == "full":  # the one tensor a block keeps, its fp32 input: exact
        assert est.total_device <= measured["total_device"] + 64 and est.total_host == measured["total_host"]


class _Casts(TorchDispatchMode):
    """Every bf16 cast of a weight (a 2-D tensor that requires grad) the forward makes, held weakly."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and args[0].dim() == 2 \
                and args[0].requires_grad:
            self.refs.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_the_training_forward_keeps_no_weight_copy_where_blocks_are_recomputed(recompute):
    """step/loss.py's autocast is uncached: autocast's cache held a bf16 copy of every block weight until the
    forward's end (after the loss), 2 B per block parameter uncounted under full and selective (13 GiB for an
    8B on one GPU). Counted at the last block's output, with the cache on (as before) and as trained."""
    from longctx.data.samples import Batch
    from longctx.step.loss import forward_loss_sum

    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, recompute, 0.0, offload_skip_last=0)
    tokens, positions, doc, labels = packed_batch(cfg, seq=SEQ, batch=BATCH)
    batch = Batch(tokens, labels, positions, doc)
    seen = {}
    for cached in (True, False):
        mode = _Casts()
        hook = model.layers[-1].register_forward_hook(lambda *_, c=cached, m=mode: seen.__setitem__(c, m.alive()))
        with mode:
            if cached:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(tokens, positions, doc, labels=labels, loss_reduction="sum")
            else:
                forward_loss_sum(model, batch, torch.bfloat16)
        hook.remove()
    assert seen[True] >= 7 * cfg.layers  # (q, k, v, o, w1, w3, w2 of every block)
    assert seen[False] == 0
