"""Audit: the chunked attention core (ops/chunked.py) cuts each row's sequence into chunks of
memory.attention_chunk, so one chunk pair holds micro_batch x chunk tokens; memory/transients.py counted a chunk
of the micro-batch's tokens laid end to end (`attention_chunks`: micro_batch x seq / chunk chunks, `pair`:
chunk tokens). With 2 sequences per micro-batch the step's peak (the core's backward, full recomputation with
block and attention chunks) read 0.91 of the estimate's: a plan the planner passes would not fit. Measured on
CPU, fp32, by live storages after every op (tests/live_storage.py), the parameters' final gradients left out."""

import pytest
import torch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.core_transients import attention_chunks
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes
from longctx.models.llama import build_model
from longctx.ops.chunked import chunk_slices
from longctx.parallel.parallelize import apply_memory


def test_attention_chunks_are_per_row():
    """As many chunks as ops/chunked.py cuts each row into (the micro-batch, which the count no longer takes,
    changes their size, not their number)."""
    for seq, ctx, c in [(2048, 1, 512), (2048, 2, 512), (1000, 1, 128), (512, 1, 512)]:
        assert attention_chunks(seq, ctx, MemoryPolicy(attention_chunk=c)) == len(chunk_slices(seq // ctx, c))


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_micro_batch_of_two_chunked_core_peak_is_estimated(preset):
    policy = MemoryPolicy("full", loss_chunk=1024, block_chunk=512, attention_chunk=512)
    cfg = load_config(None, {"model": {"preset": preset, "layers": 2}, "memory": policy.to_config()})
    model = build_model(cfg.model, seed=0)
    apply_memory(model, cfg.memory, "cpu")
    mb, seq = 2, 2048
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, seq), generator=torch.Generator().manual_seed(0))
    mode = LiveStorages()
    with mode:
        model(tokens, labels=tokens).backward()
    peak = mode.peak(besides=[p.grad for p in model.parameters()])
    acts = estimate_activations(cfg.model, seq, mb, policy=policy, dtype_bytes=4)
    est = acts.total_device + transient_bytes(cfg.model, seq, mb, head=1, ctx=1, policy=policy, dtype_bytes=4,
                                              docs=False, acts=acts)
    assert 0.97 * peak <= est <= 1.15 * peak, (est / peak, peak)
