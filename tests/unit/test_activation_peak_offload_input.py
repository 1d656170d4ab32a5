"""Under recompute = full with offload, an offloaded block's backward joins its input's host part with its
device rest into one whole tensor (memory/offload.py _unpack: torch.cat), which the recompute holds for the
block's whole backward. The activation-peak estimate (memory/transients.py) counted only the host part brought
back: with block_chunk the estimate read 0.92 of the measured peak (CPU, fp32; the planner would pass a plan that
does not fit), 0.99 with the whole input counted."""

import dataclasses

import pytest
import torch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes


@pytest.mark.parametrize("block_chunk", [512, 0])
def test_full_offload_counts_the_whole_input_made_again(block_chunk):
    from longctx.models.llama import build_model
    policy = MemoryPolicy("full", 0.5, 0, loss_chunk=1024, block_chunk=block_chunk)
    seq = 2048
    cfg = load_config(None, {"model": {"preset": "debug", "layers": 2}}).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, policy.recompute, policy.offload_fraction,
                                                  policy.offload_skip_last, block_chunk=policy.block_chunk)
    model.loss_chunk = policy.loss_chunk
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    mode = LiveStorages()
    with mode:
        model(tokens, labels=tokens).backward()
    acts = estimate_activations(cfg, seq, 1, policy=policy, dtype_bytes=4)
    # on CPU the host tier is used where it is (no copy brought back, none prefetched), in the same memory
    cpu = dataclasses.replace(acts, per_block_host=0.0)
    transient = transient_bytes(cfg, seq, 1, head=1, ctx=1, policy=policy, dtype_bytes=4, docs=False, acts=cpu)
    estimated, measured = acts.total_device + acts.total_host + transient, mode.peak()
    assert 0.97 * measured <= estimated <= 1.15 * measured, (estimated / measured, measured)
