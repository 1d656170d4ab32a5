"""Audit of the step's whole live peak (forward and backward, memory/accounting.py saved activations +
memory/transients.py transient_bytes) where test_activation_peak_estimate.py does not look: the attention core
in chunks (memory.attention_chunk) over packed documents, with block chunks or selective recomputation, on the
dense and the MoE debug models (grouped-query attention: 4 query heads over 2 kv heads), at two lengths; and
whether the peak grows linearly with the sequence: no [S, S] tensor in a document mask, the positions, the loss
or the MoE dispatch. Measured on CPU in fp32 by live storages after every op (tests/live_storage.py), the
parameters' final gradients left out (the planner counts them with the model states).

Measured 2026-12-04 (estimate / peak): full + block and attention chunks 1.04 / 1.07 (dense) and 0.99 / 1.03
(MoE) at 2K / 4K; selective + attention chunks 1.07 (dense) and 1.14 (MoE) at both."""

import pytest
import torch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes
from longctx.models.llama import build_model
from longctx.parallel.parallelize import apply_memory

POLICIES = {
    "full-chunks": MemoryPolicy("full", loss_chunk=512, block_chunk=512, attention_chunk=512),
    "selective-attention-chunks": MemoryPolicy("selective", loss_chunk=512, attention_chunk=512),
}


def packed(seq: int) -> torch.Tensor:
    """Document ids of four documents of unequal lengths (a 77-token one among them)."""
    lengths = torch.tensor([seq // 2 - 77, 77, seq // 4, seq // 4])
    return torch.repeat_interleave(torch.arange(4), lengths)[None]


def measure(preset: str, seq: int, policy: MemoryPolicy) -> tuple[int, int, float]:
    """(the step's peak live bytes, its largest single storage, the planner's estimate)."""
    cfg = load_config(None, {"model": {"preset": preset, "layers": 2}, "memory": policy.to_config()})
    model = build_model(cfg.model, seed=0)
    apply_memory(model, cfg.memory, "cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    mode = LiveStorages()
    with mode:
        model(tokens, doc_ids=packed(seq), labels=tokens).backward()
    acts = estimate_activations(cfg.model, seq, 1, policy=policy, dtype_bytes=4, docs=True)
    est = acts.total_device + transient_bytes(cfg.model, seq, 1, head=1, ctx=1, policy=policy, dtype_bytes=4,
                                              docs=True, acts=acts)
    largest = max(max(live.values(), default=0) for live in mode.steps)
    return mode.peak(besides=[p.grad for p in model.parameters()]), largest, est


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_chunked_step_peak_is_estimated_and_linear(preset, policy):
    (peak2, largest2, est2), (peak4, largest4, est4) = (measure(preset, s, policy) for s in (2048, 4096))
    for peak, est in ((peak2, est2), (peak4, est4)):
        assert 0.97 * peak <= est <= 1.15 * peak, (est / peak, peak)
    # twice the tokens: at most twice the bytes (an [S, S] fp32 tensor at 4K alone is 64 MiB, 3x the peak)
    assert peak4 <= 2 * peak2 and largest4 <= 2 * largest2, (peak4 / peak2, largest4 / largest2)
    # no tensor wider than the MLP's intermediate over all tokens (the debug presets' ffn_dim 384)
    assert largest4 <= 4096 * 384 * 4, largest4
