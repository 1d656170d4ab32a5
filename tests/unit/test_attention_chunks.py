"""Chunked attention core (memory.attention_chunk, ops/chunked.py) on one process.

The reference is the same attention without chunks: outputs and gradients in fp32 to 1e-5, with
packed documents (incl. length-1 ones and a document cut by every chunk boundary), grouped-query
attention, chunk sizes that do and do not divide the sequence, and host offload of the kept
chunks; then whole models under every recompute policy, block chunks and the chunked loss.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model
from longctx.ops.attention import attention
from longctx.ops.chunked import ChunkGrid, chunked_local_attention, local_grid
from longctx.parallel.parallelize import apply_memory
from probes import loss_and_grads, packed_batch


def _docs(batch, seq):
    doc = torch.zeros(batch, seq, dtype=torch.long)
    for c in (1, 2, 3, seq // 3 + 5, seq - 1):  # length-1 documents at both ends, a long one across chunks
        doc[0, c:] += 1
    if batch > 1:
        doc[1, seq // 2:] = 1
    return doc


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("chunk,offload", [(16, False), (24, False), (7, True), (24, True), (500, False)])
def test_chunked_core_matches_unchunked(docs, kv, chunk, offload):
    b, s, h, d = 2, 96, 4, 16
    g = torch.Generator().manual_seed(chunk + kv)
    q = torch.randn(b, s, h, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, s, kv, d, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, s, h, d, generator=g)
    doc = _docs(b, s) if docs else None
    ref, _ = attention(q, k, v, causal=True, q_doc=doc, k_doc=doc)
    ref_grads = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    out = chunked_local_attention(q, k, v, doc, chunk=chunk, offload=offload)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, a, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-5, msg=f"d{name}")


def test_grid_skips_what_the_mask_removes():
    s, chunk = 64, 16
    causal = local_grid(1, s, None, chunk, True)
    # causal, no documents: query chunk i sees key chunks 0..i, and nothing after
    assert [causal.keys_of(i) for i in range(4)] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert causal.visible() == s * (s + 1) // 2
    # four documents of 16 tokens, one per chunk: only the diagonal pairs
    doc = torch.arange(s).div(16, rounding_mode="floor")[None]
    docs = local_grid(1, s, doc, chunk, True)
    assert [docs.keys_of(i) for i in range(4)] == [[0], [1], [2], [3]]
    assert docs.visible() == 4 * 16 * 17 // 2


class _KernelTokens(TorchDispatchMode):
    """The most query and key tokens any attention kernel call sees, and the largest [.., s, heads, ..]
    k/v repeat (an op output with more than `chunk` tokens and as many heads as the queries)."""

    KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")

    def __init__(self):
        super().__init__()
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.KERNELS:
            q, k = (args[1], args[2]) if "backward" in func.__name__ else (args[0], args[1])
            self.tokens = max(self.tokens, q.shape[0] * q.shape[2], k.shape[0] * k.shape[2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("docs", [False, True])
def test_kernels_see_one_chunk_pair_at_a_time(docs):
    """Every kernel call, forward and backward, works on at most one chunk of queries and one of
    keys (batch rows counted), so the kernels' working set and the k/v repeat are O(chunk); the same
    probe on the unchunked core sees the whole sequence, so it can fail."""
    b, s, h, kv, d, chunk = 1, 512, 4, 1, 8, 64
    q = torch.randn(b, s, h, d, requires_grad=True)
    k, v = (torch.randn(b, s, kv, d, requires_grad=True) for _ in range(2))
    doc = _docs(b, s) if docs else None
    with _KernelTokens() as probe:
        chunked_local_attention(q, k, v, doc, chunk=chunk).sum().backward()
    assert 0 < probe.tokens <= chunk
    with _KernelTokens() as whole:
        attention(q, k, v, causal=True, q_doc=doc, k_doc=doc)[0].sum().backward()
    assert whole.tokens > s // 2


def test_layout_error_names_documents_that_reappear():
    doc = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]])
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="reappears"):
        chunked_local_attention(q, q[:, :, :1], q[:, :, :1], doc, chunk=4)


def test_grid_pairs_between_different_token_sets():
    """A ring block: queries at positions 32..63, keys at 0..31 of one document (all visible, no
    causal pair), and the reverse (nothing visible)."""
    qp = torch.arange(32, 64)[None].numpy()
    kp = torch.arange(0, 32)[None].numpy()
    g = ChunkGrid(qp, kp, None, None, 8, True)
    assert all(g.keys_of(i) == [0, 1, 2, 3] for i in range(4))
    assert g.visible() == 32 * 32
    g = ChunkGrid(kp, qp, None, None, 8, True)
    assert all(g.keys_of(i) == [] for i in range(4))


# ----------------------------------------------------------------------------------------------
# Whole models: every recompute policy with attention chunks against the same policy without


# (recompute, offload fraction, block chunk, attention chunk, attention offload, loss chunk)
MODEL_CASES = [("none", 0.0, 0, 16, False, 0), ("full", 0.0, 0, 24, False, 0), ("selective", 0.0, 0, 16, False, 0),
               ("selective", 0.5, 0, 16, False, 0), ("full", 1.0, 24, 16, True, 32),
               ("selective", 0.0, 16, 24, True, 32), ("full", 0.0, 16, 16, True, 0)]


@pytest.mark.parametrize("recompute,fraction,block_chunk,attention_chunk,attention_offload,loss_chunk", MODEL_CASES)
def test_model_gradients_match_without_attention_chunks(recompute, fraction, block_chunk, attention_chunk,
                                                        attention_offload, loss_chunk):
    cfg = load_config(overrides=["--model.layers=2"])
    base = build_model(cfg.model, seed=1)
    batch = packed_batch(cfg.model)
    ref_model = copy.deepcopy(base)
    apply_memory_policy(ref_model.layers, "none")
    ref_loss, ref_grads = loss_and_grads(ref_model, batch)
    model = copy.deepcopy(base)
    mem = cfg.memory
    mem.recompute, mem.offload_fraction, mem.block_chunk = recompute, fraction, block_chunk
    mem.attention_chunk, mem.attention_offload, mem.loss_chunk = attention_chunk, attention_offload, loss_chunk
    apply_memory(model, mem, "cpu")
    for _ in range(2):  # a second pass: nothing kept from the first may leak
        loss, grads = loss_and_grads(model, batch)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-5, msg=name)


def test_config_rejects_offload_without_chunks():
    with pytest.raises(ConfigError, match="attention_chunk"):
        load_config(overrides=["--memory.attention_offload=true"])
    with pytest.raises(ConfigError, match="attention_chunk must be >= 0"):
        load_config(overrides=["--memory.attention_chunk=-1"])
