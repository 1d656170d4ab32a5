"""train.loss_weighting = sequence: each trained sequence of a step counts once in its loss (LongAlign).

A packed sample holds several documents (conversations, question-answer pairs); the default loss is the
mean over the step's trained labels, so a document with a long answer weighs more than one with a short
answer, and how much a document weighs depends on what it was packed with. LongAlign's loss weighting
(Bai et al., 2024, section 3.2) makes each sequence's loss the mean over its own labels and the step's
loss the mean over its sequences:

    loss = 1/K sum_k 1/N_k sum_j loss_kj      (K sequences with a label in the global batch, N_k labels of k)

Here a label's weight is 1 / N_k (`sequence_weights`, from the rows whole: a rank holds only a piece of
each row under ctx parallelism, so it is computed before the row is cut) and the step divides the
weighted sum by K instead of the label count (`trained_sequences`; a memory-mapped store counts K from
its segment index: loader.py sequence_count). A sequence is a document of a sample (the document ids);
a document cut across two samples is two sequences; without document masks (data.doc_mask = false) a
sample is one.
"""

from __future__ import annotations

import numpy as np


def sequence_weights(labelled: np.ndarray, doc_ids: np.ndarray | None) -> np.ndarray:
    """[rows, seq] float32: 1 / (labelled tokens of its sequence) at each labelled token, 0 elsewhere.
    `labelled`: [rows, seq] bool (a token has a label); `doc_ids`: [rows, seq] each token's document in
    its row (None: the row is one sequence)."""
    return weigh_sequences(labelled, doc_ids)[0]


def weigh_sequences(labelled: np.ndarray, doc_ids: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(sequence_weights, trained_sequences) of the same rows, counted once."""
    counts, keys = _counts(labelled, doc_ids)
    labelled = np.asarray(labelled, dtype=bool)
    weights = np.zeros(labelled.shape, dtype=np.float32)
    weights[labelled] = (1.0 / counts[keys[labelled]]).astype(np.float32)
    return weights, int((counts > 0).sum())


def trained_sequences(labelled: np.ndarray, doc_ids: np.ndarray | None) -> int:
    """K: the sequences of these rows that have a labelled token."""
    counts, _ = _counts(labelled, doc_ids)
    return int((counts > 0).sum())


def _counts(labelled: np.ndarray, doc_ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Labelled tokens per (row, document) and each token's (row, document) key into them."""
    labelled = np.asarray(labelled, dtype=bool)
    rows, seq = labelled.shape
    docs = np.zeros((rows, seq), dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
    if docs.shape != labelled.shape:
        raise ValueError(f"doc_ids {docs.shape} and labelled {labelled.shape} must have one shape")
    if docs.size and docs.min() < 0:
        raise ValueError("document ids must be non-negative")
    span = int(docs.max()) + 1 if docs.size else 1
    keys = np.arange(rows, dtype=np.int64)[:, None] * span + docs
    if rows * span > 4 * max(docs.size, 1):  # (sparse ids, a caller's own: numbered densely first)
        keys = np.unique(keys, return_inverse=True)[1].reshape(rows, seq)
    return np.bincount(keys.ravel(), weights=labelled.ravel()), keys
