"""memory/transients.py with model.qk_norm (Qwen3, OLMoE) under recomputation: the q and k norms'
saved tensors (their input's fp32 copy, the normed values, an rsqrt per row) are recomputed and live
until the q/k/v projections' backward, but the transient count left them out. Measured on CPU (fp32):
a backward's peak on top of the saved activations exceeded the predicted transient by exactly those
bytes (selective: 5,144,576 against 4,198,400 predicted)."""

import pytest
import torch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes
from longctx.models.llama import build_model

SEQ = 1024
# a narrow MLP and vocabulary, so the attention side of the block's backward is the peak
SHAPE = ["--model.layers=2", "--model.dim=64", "--model.heads=8", "--model.kv_heads=8", "--model.head_dim=16",
         "--model.ffn_dim=32", "--model.vocab_size=16"]
QK_NORM = ["--model.family=qwen3", "--model.qk_norm=true"]


def backward_peak_over_saved(over: list[str], policy: MemoryPolicy) -> tuple[int, float]:
    """(a step's measured peak in backward minus the bytes saved by its forward, the parameters'
    gradients not counted; transient_bytes' prediction)."""
    cfg = load_config(overrides=[*SHAPE, *over]).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, policy.recompute, policy.offload_fraction,
                                                  offload_skip_last=policy.offload_skip_last)
    model.loss_chunk = 0
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    mode = LiveStorages()
    with mode:
        loss = model(tokens, labels=tokens)
        saved = sum(s.nbytes() for _, s in mode.held.values())
        backward_starts = len(mode.steps)
        loss.backward()
    peak = mode.peak(besides=[q.grad for q in model.parameters() if q.grad is not None], since=backward_starts)
    predicted = transient_bytes(cfg, SEQ, 1, head=1, ctx=1, policy=policy, dtype_bytes=4, docs=False)
    return peak - saved, predicted


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputed_qk_norm_tensors_are_in_the_transient(recompute):
    policy = MemoryPolicy(recompute)
    measured, predicted = backward_peak_over_saved(QK_NORM, policy)
    assert measured <= predicted, (measured, predicted)
    # the norms' share: the same block without them needs that much less, measured and predicted alike
    plain_measured, plain_predicted = backward_peak_over_saved([], policy)
    assert measured - plain_measured <= predicted - plain_predicted
