"""An independent dense reference for the attention paths' randomized tests, and the document
layouts those tests draw (tests/unit/test_attention_fuzz_reference.py,
tests/distributed/test_attention_fuzz_layouts.py).

The reference is textbook attention in float64 with autograd: every query row's scores against
every key, masked to the keys of its own document (and, causal, at or before it), softmax, values.
It is built from the document ids alone (a [seq, seq] mask), sharing no code with longctx's ops.
"""

from __future__ import annotations

import numpy as np
import torch

# the document-length shapes drawn, each an edge case of the attention paths' document handling
DOC_KINDS = ("one", "each", "aligned", "long_then_padding", "mixed")


def dense_reference(q, k, v, doc, dout, causal=True):
    """(out, (dq, dk, dv)) in float64 of attention over full sequences: q [b, s, h, d], k/v [b, s, kv, d]
    (query head i reads kv head i // (h // kv)), doc [b, s] or None (one document), dout like q.
    A row that sees no key gives 0."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    b, s, h, d = q.shape
    group = torch.arange(h) // (h // k.shape[2])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, group]) / d ** 0.5
    visible = torch.ones(b, 1, s, s, dtype=torch.bool)
    if causal:
        visible &= torch.ones(s, s, dtype=torch.bool).tril()
    if doc is not None:
        doc = torch.as_tensor(doc)
        visible &= doc[:, None, :, None] == doc[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total == 0, torch.ones_like(total), total)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v[:, :, group])
    return out.detach(), torch.autograd.grad((out * dout.double()).sum(), (q, k, v))


def doc_lengths(rng: np.random.Generator, seq: int, kind: str, share: int = 0, chunk: int = 0) -> list[int]:
    """Document lengths summing to `seq`, of one kind: "one" (one document), "each" (every token its own),
    "aligned" (boundaries exactly at multiples of a rank's `share` or of a zigzag `chunk`),
    "long_then_padding" (a document longer than a rank's share, documents of 1-3 tokens, then the rest as
    one more: a sample's padding, as data/loader.py numbers it), "mixed" (many of 1 and 2 tokens, some long)."""
    if kind == "one":
        return [seq]
    if kind == "each":
        return [1] * seq
    lengths: list[int] = []
    if kind == "aligned":
        unit = max(1, int(rng.choice([u for u in (share, chunk, share // 2) if u > 0] or [1])))
        while sum(lengths) < seq:
            lengths.append(unit * int(rng.integers(1, 3)))
    elif kind == "long_then_padding":
        share = share or max(1, seq // 4)
        lengths.append(min(seq, share + int(rng.integers(1, share + 2))))
        while sum(lengths) < seq - 3:
            lengths.append(int(rng.integers(1, 4)))
        lengths.append(seq - sum(lengths))
    else:
        while sum(lengths) < seq:
            lengths.append(int(rng.choice([1, 1, 2, 2, 3, int(rng.integers(1, seq + 1))])))
    lengths[-1] -= sum(lengths) - seq
    return [n for n in lengths if n > 0]


def doc_ids(rows: list[list[int]], first_id: int = 0) -> torch.Tensor:
    """[len(rows), seq] int64 ids numbering each row's documents first_id, first_id + 1, ..."""
    return torch.from_numpy(np.stack([np.repeat(np.arange(first_id, first_id + len(r)), r) for r in rows]))
