"""The cases of tests/distributed/test_ringdoc_fuzz120.py: seeded draws of 2D sequence-parallel layouts over 4
ranks with packed documents at their edges, and the single-device references they are compared with.

A case is a pure function of its seed (every rank draws the same one). Its rows always hold the edges the audit
is about: documents of length 1, documents shorter than a zigzag chunk, and (kind "span") one document that
reaches every context rank under either layout; documents are numbered in a shuffled order (ids need not
increase along a row). The attention reference is tests/attention_reference.py's float64 textbook attention;
the model reference is the same tiny llama run on one process over the whole rows.
"""

from __future__ import annotations

import numpy as np
import torch

WORLD = 4
MESHES = ((4, 1), (1, 4), (2, 2))  # (head, ctx): Ulysses x ring
ROUTES = ("zigzag ids", "docs layout", "zigzag layout", "attached docs layout")
ROW_KINDS = ("span", "tiny", "chunk edges", "mixed")
WINDOWS_CTX4 = (2, 0, 2, 1, 4, 2)  # Double-Ring windows of the ctx 4 cases, in turn (0 and 4: one plain ring)
IGNORE = -100


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def row_lengths(rng: np.random.Generator, seq: int, kind: str, chunk: int) -> list[int]:
    """Document lengths summing to `seq`, each row holding a document of length 1 and one shorter than a zigzag
    `chunk`. "span": a document over all but a few tokens (so over every context rank), 1-token ones around it;
    "tiny": documents of 1 to chunk - 1 tokens; "chunk edges": boundaries at multiples of a chunk, one token off
    either way; "mixed": any length."""
    if kind == "span":
        before = int(rng.integers(0, 3))
        after = int(rng.integers(1, 3))
        lengths = [1] * before + [seq - before - after] + [1] * after
    elif kind == "tiny":
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(rng.integers(1, max(2, chunk))))
    elif kind == "chunk edges":
        lengths = [1]
        while sum(lengths) < seq:
            lengths.append(chunk * int(rng.integers(1, 3)) + int(rng.choice([-1, 0, 1])))
    else:
        lengths = [1]
        while sum(lengths) < seq:
            lengths.append(int(rng.choice([1, 2, int(rng.integers(1, seq + 1))])))
    lengths = [n for n in lengths if n > 0]
    lengths[-1] -= sum(lengths) - seq
    lengths = [n for n in lengths if n > 0]
    if 1 not in lengths:  # (a trim may have eaten the one-token document: put one back)
        lengths[lengths.index(max(lengths))] -= 1
        lengths.append(1)
    return lengths


def ids_of(rows: list[list[int]], rng: np.random.Generator) -> torch.Tensor:
    """[len(rows), seq] int64 document ids, each row's documents numbered in a shuffled order."""
    out = []
    for lengths in rows:
        numbers = rng.permutation(len(lengths)) + int(rng.integers(0, 5))
        out.append(np.repeat(numbers, lengths))
    return torch.from_numpy(np.stack(out).astype(np.int64))


def draw_case(seed: int) -> dict:
    """One attention case: the layout, heads (kv heads fewer than the head degree where head % kv == 0), the
    sequence (a multiple of 2 x ctx x head), its rows of documents and how they reach the ring."""
    rng = np.random.default_rng(1200 + seed)
    head, ctx = MESHES[seed % len(MESHES)]
    kv = int(rng.choice([kv for kv in (1, 2, 4) if kv % head == 0 or head % kv == 0]))
    heads = kv * int(rng.choice([g for g in (1, 2, 4) if (kv * g) % head == 0]))
    unit = 2 * ctx * head
    seq = unit * int(rng.integers(2, max(3, 64 // unit) + 1))
    zigzag_chunk = seq // (2 * ctx)
    kinds = [ROW_KINDS[seed % len(ROW_KINDS)]] + [str(rng.choice(ROW_KINDS)) for _ in range(int(rng.integers(0, 2)))]
    window = WINDOWS_CTX4[seed // len(MESHES) % len(WINDOWS_CTX4)] if ctx == 4 else int(rng.choice([0, 1, 2]))
    return dict(seed=seed, head=head, ctx=ctx, window=window if ctx > 1 else 0,
                placement=str(rng.choice(["head-first", "ctx-first"])) if head > 1 and ctx > 1 else "head-first",
                heads=heads, kv=kv, head_dim=int(rng.choice([4, 8])), seq=seq, route=ROUTES[seed % len(ROUTES)],
                chunk=0 if rng.random() < 0.6 else int(rng.integers(1, seq // ctx + 2)),
                offload=bool(rng.random() < 0.3), rows=[row_lengths(rng, seq, kind, zigzag_chunk) for kind in kinds],
                kinds=kinds)


def draw_model_case(seed: int) -> dict:
    """One tiny-llama case: layout, kv heads (1 = fewer than head 2 or 4), rows as draw_case's."""
    rng = np.random.default_rng(1290 + seed)
    head, ctx = MESHES[seed % len(MESHES)]
    kv = int(rng.choice([kv for kv in (1, 2, 4) if kv % head == 0 or head % kv == 0]))
    seq = 48
    kinds = [ROW_KINDS[seed % len(ROW_KINDS)], str(rng.choice(ROW_KINDS))]
    return dict(seed=seed, head=head, ctx=ctx, window=2 if ctx == 4 and seed % 2 else 0,  # Double-Ring, plain ring
                placement="ctx-first" if head > 1 and ctx > 1 else "head-first", kv=kv, seq=seq,
                balance=str(rng.choice(["docs", "zigzag"])),
                rows=[row_lengths(rng, seq, kind, seq // (2 * ctx)) for kind in kinds], kinds=kinds)


def tiny_llama(kv: int):
    from longctx.config.schema import ModelConfig
    from longctx.models.llama import build_model

    cfg = ModelConfig(dim=32, layers=2, heads=4, kv_heads=kv, ffn_dim=48, vocab_size=64, max_seq_len=64)
    return build_model(cfg, seed=7)


def model_batch(case: dict):
    """(tokens, labels, positions, doc_ids) of a model case's rows, the whole rows: the labels are the next
    token inside a document, IGNORE at each document's last token (data/samples.py's rule)."""
    from longctx.models.llama import document_positions

    rng = np.random.default_rng(case["seed"])
    doc = ids_of(case["rows"], rng)
    tokens = torch.from_numpy(rng.integers(0, 64, size=doc.shape)).long()
    labels = torch.full_like(tokens, IGNORE)
    same = doc[:, 1:] == doc[:, :-1]
    labels[:, :-1] = torch.where(same, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE))
    return tokens, labels, document_positions(doc), doc


def model_reference(case: dict) -> tuple[float, dict]:
    """(summed loss, {name: gradient}) of the tiny llama on one process over the whole rows."""
    model = tiny_llama(case["kv"])
    tokens, labels, positions, doc = model_batch(case)
    loss = model(tokens, positions, doc, labels=labels, loss_reduction="sum")
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}
