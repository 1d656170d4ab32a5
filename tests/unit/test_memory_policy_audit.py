"""Audit of the memory policies (memory/): offload_fraction at its edges, auto's host-memory bound,
the offloader's reuse of a saved span, and the analytic count of what a bf16 block keeps."""

import copy

import pytest
import torch

from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.auto import choose_offload_fraction
from longctx.memory.offload import HostOffloader
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from probes import loss_and_grads, packed_batch

# (recompute, offload fraction, block chunk, offload_skip_last) at the edges: fractions that store no
# token (0.001 of 90 tokens) or all but one, chunks that do not divide the 3 x 30 tokens, every block
# offloaded, and offload_skip_last beyond the number of blocks (nothing offloaded)
EDGES = [("selective", 0.001, 0, 1), ("selective", 0.999, 0, 1), ("full", 0.001, 0, 1), ("full", 0.999, 7, 0),
         ("selective", 1.0, 0, 0), ("selective", 0.3, 7, 0), ("selective", 0.5, 0, 5), ("full", 1.0, 13, 5)]


@pytest.fixture(scope="module")
def edge_reference():
    cfg = load_config(overrides=["--model.layers=2"]).model
    model = build_model(cfg, seed=1)
    batch = packed_batch(cfg, seq=30, batch=3)  # three documents per row, every ninth label ignored
    return model, batch, loss_and_grads(model, batch)


@pytest.mark.parametrize("recompute,fraction,chunk,skip_last", EDGES)
def test_edge_policies_give_the_no_policy_gradients(edge_reference, recompute, fraction, chunk, skip_last):
    base, batch, (ref_loss, ref_grads) = edge_reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=skip_last, block_chunk=chunk)
    for _step in range(2):
        loss, grads = loss_and_grads(model, batch)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def _host_per_block(cfg, a):
    return estimate_activations(cfg, 4096, 1, policy=MemoryPolicy("selective", a)).per_block_host


def test_auto_fraction_never_exceeds_what_host_memory_holds():
    """Host memory that holds the block inputs and attention state plus 0.02 of the rest: auto must not
    round up to its 0.05 floor (that floor is for a slow link, whose transfers merely show); it put
    0.05 on a host budgeted for 0.02."""
    cfg = load_config(overrides=["--model.layers=5"]).model
    fixed = _host_per_block(cfg, 1e-9)
    other = _host_per_block(cfg, 1.0) - fixed
    host = 4 * (fixed + 0.02 * other) / 0.8  # 4 offloaded blocks, auto's 0.8 margin
    a, why = choose_offload_fraction(cfg, 4096, 1, head=1, ctx=1, skip_last=1, dtype_bytes=4, block_seconds=1.0,
                                     link_bytes_per_s=1e15, host_bytes_per_rank=host)
    assert 0 < a <= 0.02 + 1e-12
    assert 4 * _host_per_block(cfg, a) <= 0.8 * host * (1 + 1e-12)
    assert "host memory" in why
    # a slow link with ample host memory still offloads the smallest step
    a, why = choose_offload_fraction(cfg, 4096, 1, head=1, ctx=1, skip_last=1, dtype_bytes=4, block_seconds=1e-9,
                                     link_bytes_per_s=1.0, host_bytes_per_rank=1e15)
    assert a == 0.05 and "will not fully hide" in why


def test_auto_fraction_counts_the_host_tier_of_the_runs_other_settings():
    """memory.attention_offload puts the attention core's state on the host in every block, the kept
    last blocks included, and the sequence-layout output in the offloaded ones: auto must fit that
    too. Budget: exactly the rank's host tier at A = 0.5 under that policy, after the 0.8 margin."""
    cfg = load_config(overrides=["--model.layers=5"]).model
    run = MemoryPolicy(attention_chunk=1024, attention_offload=True)

    def rank_host(a):
        pol = MemoryPolicy("selective", a, 1, attention_chunk=1024, attention_offload=True)
        return estimate_activations(cfg, 4096, 1, policy=pol).total_host

    host = rank_host(0.5) / 0.8
    a, why = choose_offload_fraction(cfg, 4096, 1, head=1, ctx=1, skip_last=1, dtype_bytes=4, block_seconds=1.0,
                                     link_bytes_per_s=1e15, host_bytes_per_rank=host, policy=run)
    assert a == pytest.approx(0.5) and "host memory" in why
    assert rank_host(a) <= 0.8 * host * (1 + 1e-12)


def test_a_runs_auto_fraction_counts_its_attention_offload(monkeypatch):
    """Through the run's own path (train/model.py auto_offload_fraction): the run's [memory] settings
    reach the count, so with attention_offload the chosen fraction fits the host (0.5 here, where the
    count without them allowed more)."""
    from longctx.job.runtime import Runtime
    from longctx.memory import auto
    from longctx.train.host_budget import host_bytes_besides_offload
    from longctx.train.model import auto_offload_fraction

    cfg = load_config(overrides=["--model.layers=5", "--train.seq_len=4096", "--train.global_batch=1",
                                 "--memory.recompute=selective", "--memory.offload_fraction=auto",
                                 "--memory.offload_skip_last=1", "--memory.attention_chunk=1024",
                                 "--memory.attention_offload=true", "--train.dtype=fp32"])

    def rank_host(a):
        pol = MemoryPolicy("selective", a, 1, attention_chunk=1024, attention_offload=True)
        return estimate_activations(cfg.model, 4096, 1, policy=pol).total_host

    rt = Runtime.create(cfg, 0, 1, "cpu")
    besides = host_bytes_besides_offload(cfg, rt.dims, "cpu", 4096, 1)  # (its data loader's, the chunks' dq)
    monkeypatch.setattr(auto, "host_memory_available", lambda: (rank_host(0.5) + besides) / 0.8)
    monkeypatch.setattr(auto, "host_link_bandwidth", lambda device: 1e15)
    monkeypatch.setattr(auto, "measured_block_forward_seconds", lambda *a, **k: 1.0)
    a = auto_offload_fraction(cfg, torch.device("cpu"), rt, lambda line: None)
    assert a == pytest.approx(0.5)
    assert rank_host(a) + besides <= 0.8 * auto.host_memory_available() * (1 + 1e-12)


def test_offloader_does_not_answer_for_a_span_changed_in_place():
    """A tensor saved, changed in place, and saved again (by another op) inside one block: the second
    save must see the new values. The offloader reused the first copy (the old values): gradient
    [0, 1, 2, 3] for w2 where w2 * x with x = [0, 2, 4, 6] gives [0, 2, 4, 6]."""
    off = HostOffloader(torch.device("cpu"))
    w1 = torch.ones(4, requires_grad=True)
    w2 = torch.ones(4, requires_grad=True)
    x = torch.arange(4.0) + 0
    with off.block(0), off.offload(1.0):
        y = w1 * x  # saves x
        x.mul_(2)
        z = w2 * x  # saves x again, now doubled
    (y.sum() + z.sum()).backward()
    torch.testing.assert_close(w1.grad, torch.arange(4.0), rtol=0, atol=0)  # x as it was for y
    torch.testing.assert_close(w2.grad, 2 * torch.arange(4.0), rtol=0, atol=0)


# (recompute, offload fraction, offload_skip_last, loss_chunk) in bf16
BF16_CASES = [("none", 0.0, 1, 0), ("none", 0.0, 1, 64), ("full", 0.0, 1, 0), ("selective", 0.0, 1, 0),
              ("selective", 0.5, 1, 64), ("selective", 0.5, 0, 0), ("full", 0.5, 0, 0), ("full", 1.0, 0, 64)]


@pytest.mark.parametrize("recompute,fraction,skip_last,loss_chunk", BF16_CASES)
def test_bf16_blocks_keep_what_the_analytic_count_says(recompute, fraction, skip_last, loss_chunk):
    """bf16 weights and activations (what FSDP's bf16 param_dtype runs): a norm saves an fp32 copy of
    its input, not the input, so a block's output is held only by a checkpoint after it (the next
    block's, or the chunked loss's). The count charged every block's output (and the embeddings
    output) under none, and the last block's output without a chunked loss: 2 x dim bytes per token
    each, measured as not held."""
    from longctx.memory.accounting import layer_activations
    from longctx.memory.measured import measure_activations

    cfg = load_config(overrides=["--model.layers=3"]).model
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    model.memory_offloader = apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=skip_last)
    model.loss_chunk = loss_chunk
    tokens, positions, doc, labels = packed_batch(cfg, seq=96, batch=2)
    measured = measure_activations(model, tokens, positions, doc, labels=labels)
    policy = MemoryPolicy(recompute, fraction, skip_last, loss_chunk=loss_chunk)
    layers = layer_activations(cfg, 96, 2, policy=policy, dtype_bytes=2, docs=True)
    assert measured["blocks"] == [{"device": la.device, "host": la.host} for la in layers]
    est = estimate_activations(cfg, 96, 2, policy=policy, dtype_bytes=2, docs=True)
    # (the loss's few scalars aside)
    assert est.total_device <= measured["total_device"] <= est.total_device + 64
    assert measured["total_host"] == est.total_host
