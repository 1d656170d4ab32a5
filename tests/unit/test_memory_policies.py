"""Activation memory policies: every policy gives the `none` gradients (fp32, one process)."""

import contextlib
import copy

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy, check_policy
from longctx.memory.policy import MemoryPolicy
from probes import loss_and_grads, reference_run

# (checkpoint, offload fraction, block chunk); chunks of 16 and 24 over 2 x 64 tokens, uneven too
POLICIES = [("full", 0.0, 0), ("selective", 0.0, 0), ("selective", 0.5, 0), ("selective", 1.0, 0),
            ("selective", 0.3, 0), ("full", 0.0, 16), ("selective", 0.0, 24), ("selective", 0.5, 16),
            ("selective", 0.3, 24), ("full", 1.0, 0), ("full", 0.5, 24)]


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("policy,fraction,chunk", POLICIES)
def test_policy_gradients_match_none(reference, policy, fraction, chunk):
    cfg, base, batch, (ref_loss, ref_grads) = reference
    model = copy.deepcopy(base)
    offloader = apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    assert (offloader is not None) == (fraction > 0)
    for _step in range(2):  # a second pass: offload state from the first must not leak
        loss, grads = loss_and_grads(model, batch)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_offload_actually_moves_tensors_to_the_host_tier(reference):
    cfg, base, batch, _ = reference
    model = copy.deepcopy(base)
    offloader = apply_memory_policy(model.layers, "selective", 1.0, offload_skip_last=1)
    loss = model(*batch[:3], labels=batch[3])
    host = offloader.host_storage_ptrs()
    # two of three blocks offloaded: each has norm, MLP and attention tensors on the host
    assert len(host) >= 2 * 10
    loss.backward()


def test_offload_and_chunks_need_a_recomputing_policy():
    with pytest.raises(ConfigError, match="needs memory.recompute = selective or full"):
        check_policy("none", 0.5)
    with pytest.raises(ConfigError, match="block_chunk = 64 needs"):
        check_policy("none", 0.0, 64)
    with pytest.raises(ConfigError, match="MEMO's rule"):
        check_policy("full", "auto")
    with pytest.raises(ConfigError, match="not available"):
        check_policy("sometimes", 0.0)
    check_policy("full", 0.5, 64)  # allowed
    with pytest.raises(ConfigError, match="block_chunk"):
        load_config(overrides=["--memory.block_chunk=128"])


def _largest_ffn_wide(reference, chunk: int, backward_only: bool) -> int:
    """Elements of the largest [.., ffn_dim] tensor (not a weight) any op outputs under recompute=full
    with block_chunk=chunk, in forward and backward or in the backward alone."""
    from probes import LargestOutput

    cfg, base, batch, _ = reference
    weight_shapes = {(cfg.dim, cfg.ffn_dim), (cfg.ffn_dim, cfg.dim)}
    probe = LargestOutput(lambda t: t.dim() >= 2 and t.shape[-1] == cfg.ffn_dim and tuple(t.shape) not in weight_shapes)
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, "full", 0.0, block_chunk=chunk)
    model.loss_chunk = 32
    with probe if not backward_only else contextlib.nullcontext():
        loss = model(*batch[:3], labels=batch[3])
    with probe if backward_only else contextlib.nullcontext():
        loss.backward()
    return probe.largest


def test_chunks_bound_the_largest_tensor_a_block_creates(reference):
    """No op in a chunked block (forward and backward) outputs more than chunk x ffn_dim elements
    per tensor beyond the whole-sequence tensors attention needs (q, k, v, out: heads x head_dim);
    unchunked, the MLP creates [tokens, ffn_dim]. The probe shows the chunking is real."""
    cfg, _, batch, _ = reference
    assert _largest_ffn_wide(reference, 0, backward_only=False) == batch[0].numel() * cfg.ffn_dim
    assert _largest_ffn_wide(reference, 16, backward_only=False) == 16 * cfg.ffn_dim


def test_chunks_bound_the_recompute_inside_backward(reference):
    """Under recompute=full the backward runs each block's forward again: with block_chunk that
    recompute (and its gradients) also goes chunk by chunk, so the backward alone never makes a
    [tokens, ffn_dim] tensor (issue 49 item 2: ALST's tiled MLP bounds backward, not only forward)."""
    cfg, _, batch, _ = reference
    # unchunked, the recompute in backward does make the whole [tokens, ffn_dim]
    assert _largest_ffn_wide(reference, 0, backward_only=True) == batch[0].numel() * cfg.ffn_dim
    assert _largest_ffn_wide(reference, 16, backward_only=True) == 16 * cfg.ffn_dim


def test_auto_fraction_follows_link_and_memory_limits():
    from longctx.memory.auto import choose_offload_fraction

    cfg = load_config(overrides=["--model.layers=5"]).model

    def host(a):
        return estimate_activations(cfg, 4096, 1, policy=MemoryPolicy("selective", a)).per_block_host

    fixed, other = host(1e-9), host(1.0) - host(1e-9)  # independent of the function's own algebra
    common = dict(head=1, ctx=1, skip_last=1, dtype_bytes=4)
    # the link moves the fixed part plus 0.37 of the rest during a block's forward -> 0.35
    a, why = choose_offload_fraction(cfg, 4096, 1, block_seconds=0.01, link_bytes_per_s=(fixed + 0.37 * other) / 0.01,
                                     host_bytes_per_rank=1e15, **common)
    assert a == pytest.approx(0.35) and "host link" in why
    # plenty of link; host memory for 4 blocks x (fixed + 0.5 x other) after the 0.8 margin -> 0.5
    a, why = choose_offload_fraction(cfg, 4096, 1, block_seconds=1.0, link_bytes_per_s=1e15,
                                     host_bytes_per_rank=4 * (fixed + 0.5 * other) / 0.8, **common)
    assert a == pytest.approx(0.5) and "host memory" in why
    a, _ = choose_offload_fraction(cfg, 4096, 1, block_seconds=1.0, link_bytes_per_s=1e15,
                                   host_bytes_per_rank=1e15, **common)
    assert a == 1.0
    # not even the block inputs and attention state fit: offload off, and it says what to do
    a, why = choose_offload_fraction(cfg, 4096, 1, block_seconds=1.0, link_bytes_per_s=1e15,
                                     host_bytes_per_rank=fixed, **common)
    assert a == 0.0 and "offload_skip_last" in why


def test_auto_fraction_with_stages_is_the_smallest_over_their_shapes(monkeypatch):
    """An early stage with 4x the tokens per micro-batch of the last needs 4x the host memory: the
    fraction planned for the last stage alone would not fit during it."""
    from longctx.job.runtime import Runtime
    from longctx.memory import auto
    from longctx.train.host_budget import host_bytes_besides_offload
    from longctx.train.model import auto_offload_fraction

    cfg = load_config(overrides=["--model.layers=5", "--train.stages=256:2:8,512:2:1", "--memory.offload_skip_last=1",
                                 "--memory.recompute=selective", "--train.dtype=fp32"])

    def host(seq, batch, a):
        return estimate_activations(cfg.model, seq, batch, policy=MemoryPolicy("selective", a)).per_block_host

    # host memory for 4 blocks x (fixed + 0.5 x other) of the last stage (512 tokens x 1) beside the rank's
    # other host bytes (its data loader's), after the 0.8 margin
    rt = Runtime.create(cfg, 0, 1, "cpu")
    besides = {shape: host_bytes_besides_offload(cfg, rt.dims, "cpu", *shape) for shape in ((512, 1), (256, 8))}
    last_fixed, last_other = host(512, 1, 1e-9), host(512, 1, 1.0) - host(512, 1, 1e-9)
    monkeypatch.setattr(auto, "host_memory_available",
                        lambda: (4 * (last_fixed + 0.5 * last_other) + besides[512, 1]) / 0.8)
    monkeypatch.setattr(auto, "host_link_bandwidth", lambda device: 1e15)
    monkeypatch.setattr(auto, "measured_block_forward_seconds", lambda *a, **k: 1.0)
    lines = []
    fraction = auto_offload_fraction(cfg, torch.device("cpu"), rt, lines.append)
    alone, _ = auto.choose_offload_fraction(cfg.model, 512, 1, head=1, ctx=1, skip_last=1, dtype_bytes=4,
                                             block_seconds=1.0, link_bytes_per_s=1e15,
                                             host_bytes_per_rank=auto.host_memory_available(),
                                             host_bytes_taken=besides[512, 1])
    first, _ = auto.choose_offload_fraction(cfg.model, 256, 8, head=1, ctx=1, skip_last=1, dtype_bytes=4,
                                             block_seconds=1.0, link_bytes_per_s=1e15,
                                             host_bytes_per_rank=auto.host_memory_available(),
                                             host_bytes_taken=besides[256, 8])
    assert alone == pytest.approx(0.5) and first < alone  # the early stage is the tighter one
    assert fraction == first
    assert "smallest over train.stages' shapes: 256 tokens x 8" in lines[0] and "512 tokens x 1: 0.50" in lines[0]


def test_offload_fraction_auto_in_config():
    from longctx.config import to_toml

    cfg = load_config(overrides=["--memory.recompute=selective", "--memory.offload_fraction=auto"])
    assert cfg.memory.offload_fraction == "auto"
    assert 'offload_fraction = "auto"' in to_toml(cfg)
    with pytest.raises(ConfigError, match="offload_fraction"):
        load_config(overrides=["--memory.recompute=selective", "--memory.offload_fraction=sometimes"])


def test_chunked_full_recomputes_the_token_wise_parts_once_more(reference):
    """Under full, chunk checkpoints nest inside the block's: backward re-runs pre and post in the
    block's recompute and again per chunk. Counted FLOPs show it (selective has no nesting: equal),
    and the analytic recompute count carries it, so the planner prices it."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, base, batch, _ = reference
    flops = {}
    for policy, chunk in (("full", 0), ("full", 16), ("selective", 0), ("selective", 16)):
        model = copy.deepcopy(base)
        apply_memory_policy(model.layers, policy, 0.0, block_chunk=chunk)
        with FlopCounterMode(display=False) as counter:
            model(*batch[:3], labels=batch[3]).backward()
        flops[policy, chunk] = counter.get_total_flops()
    assert flops["selective", 16] == flops["selective", 0]
    assert flops["full", 16] > 1.15 * flops["full", 0]
    est = {c: estimate_activations(cfg, 64, 2, policy=MemoryPolicy("full", block_chunk=c)).recompute_flops
           for c in (0, 16)}
    assert est[16] > est[0]


def test_a_span_whose_storage_lost_its_memory_does_not_answer_for_a_new_tensor_at_its_address():
    """FSDP frees an unsharded weight's storage (resize to 0) after its module's forward, inside the
    block; a later activation can then be given the same address. The offloader's record of the old
    span must not hand the new tensor the old data (it did under expert parallelism with offload 0.5,
    once freed memory was reused: losses 1e-3 off)."""
    from longctx.memory.offload import HostOffloader

    off = HostOffloader(torch.device("cpu"))
    old, new = torch.arange(8.0), torch.arange(8.0) + 100
    with off.block(0), off.offload(0.5):
        packed_old = off._pack(old)
        old.untyped_storage().resize_(0)  # freed as FSDP frees it
        # the address taken by the new tensor: move the old record under it, as a reuse would
        (key,) = [k for k in off._seen]
        off._seen[(new.untyped_storage().data_ptr(), new.dtype)] = off._seen.pop(key)
        packed_new = off._pack(new)
    assert packed_new.region is not packed_old.region
    assert torch.equal(off._unpack(packed_new), torch.arange(8.0) + 100)
