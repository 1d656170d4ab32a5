"""Audit of the document-aware attention, chunked attention, block chunks and chunked loss (ops/, and how
models/llama.py and memory/apply_policy.py call them) against references written here, world 1:

- packed documents: outputs and q, k, v gradients equal each document's own causal SDPA (concatenated) for
  1-token documents, documents ending exactly on a chunk boundary, one document over the whole row, many
  tiny ones, unsorted ids, padding's own id, batch rows of different layouts; GQA with 1 and 2 kv heads and
  3 query heads per kv head; head_dim 64 / 80 / 128; chunk sizes that do not divide the sequence;
- a document id that comes back after another document is refused on every path, with the fix in words;
- cost: the attention kernels' work on packed documents is sum over documents of L (L + 1) / 2 per head,
  forward and backward, not S^2, with or without attention chunks;
- the chunked loss equals a float64 log-softmax cross-entropy (mean over scored tokens, -100 ignored, a chunk
  with no scored token, all ignored = 0 with zero gradients, per-label weights) and its gradients;
- a 2-layer model under block_chunk / attention_chunk / loss_chunk (none of them dividing the tokens) gives the
  plain model's loss and gradients; at 16K packed tokens no op outputs an S x S tensor or [S, vocab] logits.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.ops.attention import attention
from longctx.ops.chunked import chunked_local_attention
from longctx.ops.loss import lm_head_loss
from probes import LargestOutput


def _docs(*rows):
    return torch.stack([torch.from_numpy(np.repeat(np.arange(len(r)), r)) for r in rows])


def _runs(ids):
    """(start, end) of each run of one id in a row."""
    cuts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
    return list(zip(cuts[:-1], cuts[1:]))


def _reference(q, k, v, doc):
    """Per row, per document: causal SDPA over that document alone (kv heads repeated), concatenated."""
    g = q.shape[2] // k.shape[2]
    rows = []
    for r in range(q.shape[0]):
        parts = []
        for s, e in _runs(doc[r].tolist()):
            qi, ki, vi = (t[r, s:e].transpose(0, 1) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
            parts.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _compare(fn, doc, h, kv, d, dtype, tol):
    b, s = doc.shape
    g = torch.Generator().manual_seed(s + h + d)
    q, k, v = (torch.randn(b, s, n, d, dtype=dtype, generator=g) for n in (h, kv, kv))
    dout = torch.randn(b, s, h, d, dtype=dtype, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, doc)
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*refs, doc)
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), refs)
    assert (out.double() - ref).abs().max() < tol
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() < tol


LAYOUTS = {  # all rows of 16 tokens; chunks of 5 and 8 below
    "one_token_docs": [(1, 5, 1, 1, 7, 1)],
    "ends_on_chunk_boundary": [(8, 5, 3)],
    "whole_row": [(16,)],
    "tiny": [(1, 2) * 5 + (1,)],
    "rows_differ": [(4, 4, 4, 4), (1, 15), (16,), (3, 5, 2, 6)],
    "rows_alike": [(4, 4, 4, 4), (4, 4, 4, 4)],
}
PATHS = {
    "flash": lambda q, k, v, doc: attention(q, k, v, q_doc=doc, k_doc=doc)[0],
    "math": lambda q, k, v, doc: attention(q, k, v, q_doc=doc, k_doc=doc, backend="math")[0],
    "chunk5": lambda q, k, v, doc: chunked_local_attention(q, k, v, doc, chunk=5),
    "chunk8_offload": lambda q, k, v, doc: chunked_local_attention(q, k, v, doc, chunk=8, offload=True),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-11)])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_documents_match_each_document_alone(layout, path, dtype, tol):
    doc = _docs(*LAYOUTS[layout])
    for h, kv, d in ((4, 1, 16), (6, 2, 8), (6, 3, 64)):
        _compare(PATHS[path], doc, h, kv, d, dtype, tol)


def test_unsorted_ids_and_a_padding_id_are_documents_of_their_own():
    # ids in any order, and the loader's padding id (the next one, data/loader.py) or a negative one
    doc = torch.tensor([[3, 3, 3, 0, 0, 1, 1, 1, 1, 7, 7, 2, 9, 9, 9, 9],
                        [5, 5, 4, 4, 4, 4, 4, 4, 4, 4, 4, -1, -1, -1, -1, -1]])
    for path in PATHS.values():
        _compare(path, doc, 4, 2, 8, torch.float32, 1e-5)


@pytest.mark.parametrize("d", [80, 128])
def test_head_dims_80_and_128(d):
    doc = _docs((1, 9, 6), (16,))
    for path in PATHS.values():
        _compare(path, doc, 3, 1, d, torch.float32, 1e-5)


def test_a_document_id_that_comes_back_is_refused_on_every_path():
    q = torch.randn(1, 6, 2, 8)
    doc = torch.tensor([[0, 0, 1, 1, 0, 0]])
    for path in PATHS.values():
        with pytest.raises(ValueError, match="reappears after another document.*number each packed document anew"):
            path(q, q, q, doc)


class _KernelWork(TorchDispatchMode):
    """Query-key pairs the CPU flash kernels compute (forward and backward), per head: a causal call of n
    queries counts n (n + 1) / 2, a full one n x keys."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_scaled_dot_product_flash_attention_for_cpu" in name:
            backward = "backward" in name
            q, k = (args[1], args[2]) if backward else (args[0], args[1])
            causal = (args[7] if backward else args[4]) if len(args) > (7 if backward else 4) else \
                (kwargs or {}).get("is_causal", False)
            n, m = q.shape[-2], k.shape[-2]
            work = q.shape[0] * (n * (n + 1) // 2 if causal else n * m)
            if backward:
                self.backward += work
            else:
                self.forward += work
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk", [0, 512, 100])
def test_packed_work_is_the_documents_not_the_sequence(chunk):
    """60 documents of 1..299 tokens (9003 tokens): the kernels compute the documents' triangles, each
    once forward and once backward (2.3% of the S^2 causal triangle), also in attention chunks."""
    lengths = np.random.default_rng(0).integers(1, 300, size=60)
    doc = torch.from_numpy(np.repeat(np.arange(60), lengths))[None]
    s = int(lengths.sum())
    q, k, v = (torch.randn(1, s, n, 16, requires_grad=True) for n in (2, 1, 1))
    with _KernelWork() as work:
        out = chunked_local_attention(q, k, v, doc, chunk=chunk) if chunk else \
            attention(q, k, v, q_doc=doc, k_doc=doc)[0]
        out.sum().backward()
    ideal = int(sum(n * (n + 1) // 2 for n in lengths.tolist())) * q.shape[0]  # per batch row
    assert work.forward == ideal and work.backward == ideal, (work.forward, work.backward, ideal)
    assert ideal < 0.03 * s * (s + 1) // 2


# ------------------------------------------------------------------------------------------------
# The chunked loss


def _ce_reference(h, w, labels, norm_w, eps, weights=None):
    x = h.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
    logp = torch.log_softmax(x @ w.double().t(), -1)
    valid = labels != -100
    nll = -logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    factor = valid.double() if weights is None else torch.where(valid, weights.double(), 0.0)
    total = (nll * factor).sum()
    return total / factor.sum() if bool(valid.any()) else total


@pytest.mark.parametrize("case", ["every_third_ignored", "a_chunk_all_ignored", "all_ignored", "weights"])
@pytest.mark.parametrize("chunk", [0, 7, 10, 36])
def test_chunked_loss_equals_float64_cross_entropy(case, chunk):
    n, dim, vocab = 37, 16, 50
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(n, dim, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, requires_grad=True)
    norm_w = (1 + 0.1 * torch.randn(dim, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = None
    if case == "every_third_ignored":
        labels[::3] = -100
    elif case == "a_chunk_all_ignored":
        labels[5:25] = -100  # chunks 10..19 (chunk 10) and 7..13 (chunk 7) score nothing
    elif case == "all_ignored":
        labels[:] = -100
    else:
        labels[::4] = -100
        weights = torch.rand(n, generator=g)
    loss = lm_head_loss(h, w, labels, chunk=chunk, norm=(norm_w, 1e-5), label_weights=weights)
    grads = torch.autograd.grad(loss, (h, w, norm_w))
    if case == "all_ignored":
        assert loss.item() == 0 and all(torch.count_nonzero(g_) == 0 for g_ in grads)
        return
    refs = [t.detach().double().requires_grad_() for t in (h, w, norm_w)]
    ref = _ce_reference(*refs[:2], labels, refs[2], 1e-5, weights)
    ref_grads = torch.autograd.grad(ref, refs)
    assert abs(loss.item() - ref.item()) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# The model under block chunks, attention chunks and loss chunks


def _model_and_batch(seq, layers=2, dtype=torch.float32, **overrides):
    from longctx.config import load_config
    from longctx.models.llama import build_model

    cfg = load_config(overrides=[f"--model.layers={layers}"] + [f"--model.{k}={v}" for k, v in overrides.items()]).model
    model = build_model(cfg, seed=1).to(dtype)
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, seq), generator=g)
    labels[:, ::5] = -100
    return model, tokens, labels


def _memory(model, block_chunk=0, attention_chunk=0, loss_chunk=0, recompute="selective"):
    from longctx.parallel.parallelize import apply_memory

    apply_memory(model, SimpleNamespace(offload_fraction=0.0, attention_chunk=attention_chunk, attention_offload=False,
                                        recompute=recompute, offload_skip_last=1, block_chunk=block_chunk,
                                        loss_chunk=loss_chunk, expert_chunk=0), "cpu")
    return model


def _loss_and_grads(model, tokens, labels, doc, pos):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, doc.clone(), labels=labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("recompute,block,attn,loss_chunk", [
    ("selective", 5, 0, 0), ("full", 7, 0, 0), ("none", 0, 6, 0), ("none", 0, 0, 11), ("selective", 10, 9, 8),
    ("full", 3, 4, 5)])
def test_model_chunks_change_no_result(recompute, block, attn, loss_chunk, dtype, tol):
    model, tokens, labels = _model_and_batch(37, dtype=dtype)
    doc = _docs((1, 12, 8, 16), (37,))
    pos = torch.stack([torch.cat([torch.arange(n) for n in (1, 12, 8, 16)]), torch.arange(37)])
    ref_loss, ref_grads = _loss_and_grads(model, tokens, labels, doc, pos)
    chunked = _memory(copy.deepcopy(model), block, attn, loss_chunk, recompute)
    loss, grads = _loss_and_grads(chunked, tokens, labels, doc, pos)
    assert abs(loss.item() - ref_loss.item()) < tol
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)


def test_16k_packed_tokens_hold_no_s_by_s_tensor_nor_whole_logits():
    """A 1-layer debug model, one row of 16K tokens in 7 documents, block_chunk 1000, attention_chunk 1500,
    loss_chunk 1024 (none divides 16384): no op outputs S x S / 64 elements or [S, vocab] logits."""
    seq = 16384
    model, tokens, labels = _model_and_batch(seq, layers=1)
    model = _memory(model, 1000, 1500, 1024)
    lengths = (5000, 1, 3000, 4096, 7, 2000, seq - 14104)
    doc = _docs(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with LargestOutput() as probe:
        loss = model(tokens[:1], pos, doc, labels=labels[:1])
        loss.backward()
    vocab, ffn = model.cfg.vocab_size, model.cfg.ffn_dim
    assert probe.largest < seq * seq // 64, probe.largest
    assert probe.largest < seq * vocab and probe.largest < seq * ffn, (probe.largest, seq * vocab, seq * ffn)
