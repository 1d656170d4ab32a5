"""memory.block_chunk with gradients kept across micro-batches: autograd sums a weight's gradient over the block's
chunks in a buffer of its own before adding it to the kept .grad, one block's fp32 gradients on top of the
activations during the block's backward. The estimate had no such term (a llama3-1b-shaped block at 2K-4K
tokens peaked 1.6-2.3x the activation estimate): costs/model_states.py chunk_grad_buffer_bytes, a part of
device_bytes ("chunk_grad_buffers") where the gradients are kept, and nowhere else."""

import pytest
import torch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.costs.host_bytes import device_bytes
from longctx.costs.model_states import chunk_grad_buffer_bytes, param_counts
from longctx.costs.shape import MeshShape
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes
from longctx.models.llama import build_model

# wide and short: the block's weights (1.2M parameters, 4.7 MB of fp32 gradients) outweigh its activations
WIDE = {"preset": "debug", "layers": 2, "dim": 256, "ffn_dim": 1024, "heads": 4, "kv_heads": 2}
SEQ, CHUNK = 512, 128


def test_a_chunked_block_with_kept_gradients_peaks_by_one_blocks_gradients_over_the_activations():
    cfg = load_config(None, {"model": WIDE}).model
    model = build_model(cfg, seed=0)
    apply_memory_policy(model.layers, "full", 0.0, 1, block_chunk=CHUNK)
    for p in model.parameters():  # (kept from an earlier micro-batch: grad_accum > 1)
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    mode = LiveStorages()
    with mode:
        model(tokens, labels=tokens).backward()
    policy = MemoryPolicy("full", block_chunk=CHUNK)
    acts = estimate_activations(cfg, SEQ, 1, policy=policy, dtype_bytes=4)
    activations = acts.total_device + transient_bytes(cfg, SEQ, 1, head=1, ctx=1, policy=policy, dtype_bytes=4,
                                                      docs=False, acts=acts)
    buffers = chunk_grad_buffer_bytes(cfg, MeshShape(1, 1, 1, 1), "device", "step", 2, CHUNK)
    measured = mode.peak()
    assert activations < 0.8 * measured  # (the regime: the activations alone miss a large share)
    assert 0.97 * measured <= activations + buffers <= 1.2 * measured, ((activations + buffers) / measured, measured)


@pytest.mark.parametrize("world, tier, grad_sync, grad_accum, block_chunk, kept", [
    (1, "device", "step", 2, 128, True),            # one rank without FSDP: .grad kept across micro-batches
    (1, "device", "step", 1, 128, False),           # one micro-batch: the buffer becomes the gradient
    (1, "device", "step", 2, 0, False),             # no chunks: no buffer
    (1, "host_optimizer", "step", 2, 128, False),   # the host tier's one-rank FSDP unit: fresh each time
    (8, "device", "step", 2, 128, True),            # FSDP accumulating unsharded (grad_sync step)
    (8, "device", "micro_batch", 2, 128, False),    # reduce-scattered after every micro-batch
])
def test_the_buffer_is_counted_only_where_gradients_are_kept(world, tier, grad_sync, grad_accum, block_chunk, kept):
    cfg = load_config(None, {"model": WIDE}).model
    shape = MeshShape(1, world)
    memory = device_bytes(cfg, shape, tier, grad_sync, grad_accum, 4, 1.0, 1.0, block_chunk=block_chunk)
    want = 4.0 * (param_counts(cfg)["block"] + 256 * 1024) if kept else 0.0  # (+ the sum of its largest weight)
    assert memory.get("chunk_grad_buffers", 0.0) == want
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))
