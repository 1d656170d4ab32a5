"""How much attention work packed documents leave: `doc_work`, from document ids or a data store.

With document masks a query attends only to earlier keys of its own document, and the attention
kernels run only those pairs (ops/segments.py plans same-document segment pairs; ops/attention.py
and ops/varlen.py run them). A sequence of S tokens packed from documents of L_1, L_2, ... tokens
(trailing padding is a document of its own: it is attended like one) has

    sum_d L_d (L_d + 1) / 2   visible query-key pairs, against   S (S + 1) / 2   under a plain causal mask.

`doc_work` is the mean of that ratio over sequences: the planner multiplies its causal attention
FLOPs by it (planner/cost.py). 1.0 = one document per sequence, the conservative default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..data.loader import PackedSamples
from ..data.store import read_manifest
from ..errors import ConfigError, DataError

MAX_SAMPLES = 2000  # samples read from a store: enough for a mean to ~1% (deterministic, evenly spaced)


def visible_pairs(doc_row) -> int:
    """Causal same-document query-key pairs of one sequence of document ids ([seq]): a document is
    a run of equal ids (the loader numbers each packed document anew)."""
    ids = np.asarray(doc_row).reshape(-1)
    if ids.size == 0:
        return 0
    starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1])
    lengths = np.diff(np.concatenate([starts, [ids.size]])).astype(np.int64)
    return int((lengths * (lengths + 1) // 2).sum())


def doc_work_of_ids(doc_ids) -> float:
    """Mean over the rows of `doc_ids` [batch, seq] of visible pairs / plain causal pairs."""
    ids = np.asarray(doc_ids.detach().cpu().numpy() if hasattr(doc_ids, "detach") else doc_ids)
    if ids.ndim == 1:
        ids = ids[None]
    s = ids.shape[1]
    causal = s * (s + 1) // 2
    return float(np.mean([visible_pairs(row) / causal for row in ids])) if len(ids) else 1.0


def sample_indices(n: int, limit: int = MAX_SAMPLES) -> np.ndarray:
    """`limit` evenly spaced sample indices of n (all of them when n <= limit): deterministic."""
    if n <= limit:
        return np.arange(n, dtype=np.int64)
    return np.arange(limit, dtype=np.int64) * n // limit


def store_manifest(root: str | Path, seq_len: int, vocab_size: int | None = None, flag: str = "--store") -> dict:
    """The manifest of the store a plan costs and writes as data.path, once it fits the plan as `longctx
    train` checks it (train/setup.py `_check_store`): samples of `seq_len` tokens and, with `vocab_size` (the
    model's), a tokenizer whose ids are all below it. Checked whether or not the documents are costed
    (data.doc_mask = false costs none): a plan written for a store its run then refuses is no plan."""
    root = Path(root)
    try:
        manifest = read_manifest(root)
    except DataError as e:
        raise ConfigError(f"{flag}: {e}") from None
    store_seq = int(manifest["seq_len"])
    if store_seq != seq_len:
        raise ConfigError(
            f"{flag} {root} holds samples of {store_seq:,} tokens (its manifest's seq_len), but --seq-len is "
            f"{seq_len:,}: the documents' share of the attention work depends on the sequence length. Plan with "
            f"--seq-len {store_seq}, or build a store at {seq_len} tokens (longctx data build --seq-len {seq_len}).")
    tok = manifest["tokenizer"]
    if vocab_size is not None and int(tok["vocab_size"]) > vocab_size:
        raise ConfigError(
            f"{flag} {root} was tokenized with {tok['spec']}, of {int(tok['vocab_size']):,} tokens, but the model "
            f"has {vocab_size:,} (model.vocab_size): the written plan's run would refuse the store. Plan with "
            f"--model.vocab_size={int(tok['vocab_size'])} (or more), or a store built with the model's tokenizer.")
    return manifest


def store_doc_work(root: str | Path, seq_len: int, limit: int = MAX_SAMPLES,
                   flag: str = "--store") -> tuple[float, int, int]:
    """(doc_work, samples read, train samples in the store) of the store at `root`, whose samples
    must be `seq_len` tokens (the plan's sequence length). Reads the document ids the training
    loop sees (`PackedSamples(root, "train", True).frames([i]).doc_ids`, from the segment index) of at most
    `limit` samples, never their tokens: a batch() read each sample's every token (2,000 x seq_len of them,
    4 GB at 1M tokens) for ids that do not depend on them."""
    root = Path(root)
    store_manifest(root, seq_len, flag=flag)
    samples = PackedSamples(root, "train", True)
    n = len(samples)
    if n == 0:
        raise ConfigError(f"{flag} {root} has no training samples to measure the documents of.")
    idx = sample_indices(n, limit)
    causal = seq_len * (seq_len + 1) // 2
    work = [visible_pairs(samples.frames([int(i)]).doc_ids[0]) / causal for i in idx]
    return float(np.mean(work)), len(idx), n
