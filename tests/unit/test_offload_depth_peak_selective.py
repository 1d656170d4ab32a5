"""Selective recomputation with token-wise offload (memory.recompute = selective, offload_fraction > 0,
MEMO's policy): depth must not change the device peak of backward beyond what each block keeps on the
device by design.

Block i-1's host parts (under selective its whole host tier: block input, attention state, the stored
tokens' activations) used to be prefetched at block i's first unpack, so they sat on the device through
block i's whole backward, its post (MLP) phase included, while block i's own tier, itself prefetched
whole, was there too: on CPU with device copies made real (block_chunk 128, offload_fraction 0.5, one
block's host tier 2.25 MB) 2/3/4 layers peaked at 2.49/4.49/6.48 MB, of which the forward's own growth
(2.34 - 1.92 = 0.43 MB a layer: the stored pieces' bf16 weight copies, which stay on the device by
design) explains 0.43 MB a layer. memory/offload.py prefetch_mark now brings block i-1 back after block
i's attention core has run backward, as under full recomputation (test_offload_depth_peak.py, whose
device-copy technique this reuses). The depth test runs block_chunk 256 (half the pieces: half the time)."""

import dataclasses
import functools

import pytest
import torch
from test_offload_depth_peak import CHUNK, DIM, DeviceLive, _Batch, _device_copies, schedule_log

from longctx.config import load_config
from longctx.memory.accounting import (
    estimate_activations,
    loss_saved_bytes,
    offloaded_tier_after_post,
)
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.block_parts import block_part_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import backward_phase_bytes, kept_blocks_freed_bytes, transient_bytes
from longctx.models.llama import build_model
from longctx.ops.chunked import ChunkedLocalCore
from longctx.step.host_optimizer import HostOptimizer, forward_units
from longctx.step.loss import forward_loss_sum


def _model(layers: int, fraction: float, chunk: int):
    cfg = load_config(None, {"model": {"preset": "debug", "dim": DIM, "layers": layers, "heads": 4, "kv_heads": 1,
                                       "head_dim": 16, "ffn_dim": DIM * 7 // 2, "vocab_size": 128}})
    model = build_model(cfg.model, seed=0)
    for block in model.layers:
        block.attention.core = ChunkedLocalCore(CHUNK)
    offloader = apply_memory_policy(model.layers, "selective", fraction, offload_skip_last=1, block_chunk=chunk)
    model.loss_chunk = CHUNK
    model.host_optimizer = HostOptimizer([{"params": list(model.parameters())}], forward_units(model), lr=1e-3)
    return model, offloader


def _host_tier_bytes(offloader) -> int:
    return sum(t.untyped_storage().nbytes() for r in offloader.host_tensors if (t := r()) is not None)


def _peaks(layers: int, fraction: float, chunk: int) -> tuple[int, int, int, dict]:
    """(backward's device peak, forward's, one offloaded block's host-tier bytes, fetch counts)."""
    model, offloader = _model(layers, fraction, chunk)
    counts = _device_copies(offloader)
    mode = DeviceLive(offloader.host_storage_ptrs)
    with mode:
        loss = forward_loss_sum(model, _Batch(128), torch.bfloat16)
        forward, share = mode.peak, _host_tier_bytes(offloader) // (layers - 1)
        loss.backward()
    return mode.peak, forward, share, counts


@pytest.mark.parametrize("fraction,chunk", [(0.5, 2 * CHUNK), (1.0, 0)])
def test_depth_adds_to_the_backward_peak_only_what_the_forward_keeps(fraction, chunk):
    peaks, forwards = {}, {}
    for layers in (2, 4):
        peaks[layers], forwards[layers], share, counts = _peaks(layers, fraction, chunk)
        assert counts["fetched"] > 0  # the host parts came back as device copies
    # each block keeps some bytes on the device by design (the stored pieces' bf16 weight copies: the forward's
    # peak grows by them); before, backward grew by one to two blocks' host tiers (share) more than that
    growth = (peaks[4] - peaks[2]) - (forwards[4] - forwards[2])
    assert abs(growth) < share // 8, (peaks, forwards, share)


def test_the_block_before_comes_back_after_the_core_backward_and_before_its_use():
    layers = 4
    log = schedule_log(*_model(layers, 0.5, 0))
    for i in range(1, layers):  # block i brings back block i - 1 (the kept block, 3, too)
        done, fetched = log.index(("core done", i)), log.index(("prefetch", i - 1))
        used = log.index(("unpack", i - 1))
        assert done < fetched < used, log
    assert ("prefetch", -1) not in log


def _loss_and_grads(fraction: float, chunk: int, old_schedule: bool):
    model, offloader = _model(3, fraction, chunk)
    _device_copies(offloader)
    if old_schedule:  # block i - 1 back at block i's first unpack, no marks
        offloader.prefetch_on_unpack = True
        for block in model.layers:
            block.forward = functools.partial(block.forward.func, **{**block.forward.keywords, "mark": None})
    loss = forward_loss_sum(model, _Batch(128), torch.bfloat16)
    loss.backward()
    return loss.item(), model.host_optimizer.host_gradients()


@pytest.mark.parametrize("fraction,chunk", [(0.5, CHUNK), (1.0, 0)])
def test_the_schedule_changes_no_value(fraction, chunk):
    loss, grads = _loss_and_grads(fraction, chunk, old_schedule=False)
    ref_loss, ref_grads = _loss_and_grads(fraction, chunk, old_schedule=True)
    assert loss == ref_loss
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_the_accounting_counts_the_block_before_in_the_pre_phase_only():
    """memory/transients.py: an offloaded block's backward holds its own host tier whole in its post phase, then
    only what its core's and pre's backward still read (memory/accounting.py offloaded_tier_after_post), and
    the block before's (prefetched) in its pre phase only; before, both whole throughout (2 x the host tier on
    top of the largest phase: 144.13 GiB for llama3-8b at 512K tokens, selective, offload 0.5, block_chunk 8K),
    then its own whole throughout (122.72, the tier counted twice in the pre phase); then 76.66, 76.77 with
    the weight gradients summed over the block's pieces (weight_grads.py weight_grad_sum_bytes), now 66.92 with the
    pre phase by stages and the kept block's saved activations (its core state, 10.06 GiB) credited in the
    offloaded blocks' backward, which runs after it (transients.py kept_blocks_freed_bytes)
    (test_selective_offload_peak.py measures the peak)."""
    cfg = load_config(None, {"model": {"preset": "llama3-8b"}}).model
    seq, policy = 512 * 1024, MemoryPolicy("selective", 0.5, 1, loss_chunk=8192, block_chunk=8192)
    acts = estimate_activations(cfg, seq, 1, policy=policy, dtype_bytes=2)
    transient = transient_bytes(cfg, seq, 1, head=1, ctx=1, policy=policy, dtype_bytes=2, docs=False, acts=acts)
    phases = {kept: backward_phase_bytes(cfg, seq, 1, head=1, ctx=1, window=0, docs=False, dtype_bytes=2,
                                         policy=dataclasses.replace(policy, offload_fraction=0.0) if kept else policy)
              for kept in (False, True)}
    host, t = acts.per_block_host, acts.tokens
    pre, core = offloaded_tier_after_post(block_part_bytes(cfg, 1, 2), 2, cfg.dim, 0.5)
    own = {"post": host, "core": t * (pre + core), "pre": t * pre + host}  # (pre: the block before's too)
    assert t * (pre + core) < host / 2  # (the case where the phases matter)
    kept_freed = kept_blocks_freed_bytes(cfg, seq, 1, head=1, ctx=1, policy=policy, e=2, docs=False)
    assert kept_freed == pytest.approx(t * block_part_bytes(cfg, 1, 2)["core"])  # (the kept block's core state)
    offloaded = max(v + own[k] for k, v in phases[False].items()) - kept_freed
    kept = max(v + (host if k == "pre" else 0.0) for k, v in phases[True].items())
    freed = loss_saved_bytes(cfg, seq, 1, policy=policy, dtype_bytes=2)
    assert transient == pytest.approx(max(offloaded, kept) - freed + 4)  # (+ the backward's seed, a scalar)
    assert transient / 2**30 == pytest.approx(66.92, abs=0.01)
