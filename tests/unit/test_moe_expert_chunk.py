"""memory.expert_chunk: the experts run on at most `chunk` rows at a time (each piece recomputed in
backward), with the results and gradients of the unchunked run."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers
from longctx.models.moe_experts import swiglu_experts
from longctx.parallel.parallelize import apply_memory


class _WidestMatmul(TorchDispatchMode):
    """The most rows of any SwiGLU activation (silu, forward or backward): the experts' intermediates
    [rows, hidden], the tensors expert_chunk bounds."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.silu, torch.ops.aten.silu_backward):
            self.rows = max(self.rows, out.shape[0])
        return out


def _weights(experts=4, dim=16, hidden=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: (torch.randn(*s, generator=gen) * 0.2).requires_grad_()  # noqa: E731
    return make(experts, hidden, dim), make(experts, hidden, dim), make(experts, dim, hidden)


@pytest.mark.parametrize("chunk", [7, 32, 64])
def test_chunked_experts_equal_the_whole_and_bound_the_rows(chunk):
    w1, w3, w2 = _weights()
    counts = torch.tensor([37, 0, 5, 58])  # a skewed load, an empty expert, pieces cutting through experts
    x = torch.randn(100, 16).requires_grad_()
    whole = swiglu_experts(x, counts, w1, w3, w2)
    g_whole = torch.autograd.grad(whole.square().sum(), [x, w1, w3, w2])
    with _WidestMatmul() as probe:
        part = swiglu_experts(x, counts, w1, w3, w2, chunk)
        g_part = torch.autograd.grad(part.square().sum(), [x, w1, w3, w2])
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_part, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert probe.rows <= chunk, (probe.rows, chunk)


def test_expert_chunk_reaches_the_model_and_keeps_its_loss():
    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.moe.dense_layers=",
                                 "--memory.recompute=selective", "--memory.expert_chunk=48"])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for chunk in (0, 48):
        model = build_model(cfg.model)
        apply_memory(model, cfg.memory.__class__(**{**vars(cfg.memory), "expert_chunk": chunk}), "cpu")
        assert all(layer.experts.chunk == chunk for layer in moe_layers(model))
        with _WidestMatmul() as probe:
            loss = model(tokens, labels=tokens)
            loss.backward()
        losses.append(loss.item())
        # every layer is MoE here: the SwiGLU activations are the experts' only
        assert probe.rows == (48 if chunk else 2 * 64 * cfg.model.moe_top_k), probe.rows
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
