"""Scaling audit of the paths around the attention kernels (training, eval, generation, packing, data).

The one finding: GliDe draft training's block-stale cross-attention (models/glide.py cross_attention) ran
queries in chunks so that no [n, S] mask exists at once, but under autograd the kernel kept each chunk's
fp32 additive mask [chunk x group, range] for backward, so the step held ~group x n x S / 2 floats until
backward (quadratic: at 4K tokens of the debug draft 84 of its 157 MB saved for backward). Each chunk
is now checkpointed; what is kept for backward stays O(S), and the values and gradients are unchanged.
"""

import math

import pytest
import torch

from longctx.models.glide import block_stale_limit, cross_attention


def _inputs(n, heads=4, kv=2, d=8, docs=1, grad_kv=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, heads, d, generator=g, requires_grad=True)
    k = torch.randn(1, kv, n, d, generator=g, requires_grad=grad_kv)
    v = torch.randn(1, kv, n, d, generator=g, requires_grad=grad_kv)
    doc = (torch.arange(n) * docs // n)[None]  # `docs` documents of equal length, back to back
    starts = torch.searchsorted(doc[0], doc[0], right=False)
    pos = (torch.arange(n) - starts)[None]
    return q, k, v, doc, pos


def _loss(q, k, v, visible, chunk, pos, doc):
    return cross_attention(q, k, v, visible, chunk, key_pos=pos, q_doc=doc, k_doc=doc).sum()


def _saved_for_backward(fn, args) -> int:
    """Elements autograd keeps for backward while fn(*args) runs, in storages other than the inputs' own."""
    own = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = max(kept.get(ptr, 0), t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(kept.values())


@pytest.mark.parametrize("docs", [1, 3])
def test_cross_attention_keeps_o_of_s_for_backward(docs):
    """Before the fix the chunks' fp32 masks were kept, ~group x n x S / 2 elements for one document: 1.37M at
    1024 tokens, 4.84M at 2048 (x3.5; 74x the queries); with 3 documents 0.85M -> 2.40M. After: nothing beyond
    the inputs (each checkpoint keeps views of them)."""
    block, chunk = 4, 256
    counts = {}
    for n in (1024, 2048):
        q, k, v, doc, pos = _inputs(n, docs=docs)
        visible = block_stale_limit(pos, block)
        counts[n] = _saved_for_backward(_loss, (q, k, v, visible, chunk, pos, doc))
        assert counts[n] <= 2 * q.numel(), f"{counts[n]} elements kept for backward at {n} tokens (q: {q.numel()})"
    assert counts[2048] <= 2.2 * max(counts[1024], 1)


def _reference(q, k, v, visible, key_pos, q_doc, k_doc):
    """Float64, position by position: query i of the single row reads keys j with key_pos[j] < visible[i] of
    its document (GQA: query head h reads kv head h // (heads / kv)); 0 where it reads none."""
    _, n, heads, d = q.shape
    kv = k.shape[1]
    qf, kf, vf = q.double()[0], k.double()[0], v.double()[0]
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    for i in range(n):
        seen = (key_pos[0] < visible[0, i]) & (k_doc[0] == q_doc[0, i])
        if not seen.any():
            continue
        for h in range(heads):
            keys, values = kf[h // (heads // kv), seen], vf[h // (heads // kv), seen]
            p = torch.softmax(keys @ qf[i, h] / math.sqrt(d), dim=0)
            out[i, h] = p @ values
    return out[None]


def test_checkpointed_chunks_give_the_reference_values_and_gradients():
    """Forward and the gradients of q, k and v (k and v made trainable so their path through the
    checkpoints is checked too) against a float64 reference, with documents and chunk edges inside them."""
    block, chunk, n = 3, 16, 70
    q, k, v, doc, pos = _inputs(n, docs=3, grad_kv=True, seed=1)
    visible = block_stale_limit(pos, block)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    got = cross_attention(q, k, v, visible, chunk, key_pos=pos, q_doc=doc, k_doc=doc)
    (got * w).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, visible, pos, doc, doc)
    (want * w.double()).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for name, mine, ref in zip("qkv", grads, leaves):
        torch.testing.assert_close(mine.double(), ref.grad, atol=1e-5, rtol=1e-5, msg=f"d{name}")
