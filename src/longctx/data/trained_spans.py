"""Which tokens of a store's documents are trained on (instruction data: the answers, not the prompts).

Per document, training switches on and off at token offsets: off before `first` (store.LOSS_FROM; 0 for
a plain document, every token trained), on from it, then off and on again at each of its `gaps`
(store.LOSS_GAPS: a conversation's user turns between two answers, `off, on, off, on, ...`, an even
number of offsets after `first`); the last span trained runs to the document's end, its EOS included.
A part with no gaps file has none in any document, and the two queries below are one formula each.

Both queries take arrays of (document, offset) pairs, so the loader asks them for every segment of a
part at once (its label counts) or for every token of a sample (its label mask) without a Python loop.
`part_trained_spans` reads a store part's (refusing a part whose files disagree with its manifest);
`trained_token_mask` marks a block of its samples' trained tokens (the GliDe vocabulary's count).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError
from .store import (
    LOSS_FROM,
    LOSS_GAPS,
    S_DOC,
    S_LENGTH,
    S_OFFSET,
    S_SAMPLE,
    S_START,
    answer_gap_documents,
    load_loss_from,
    load_loss_gaps,
    response_only_documents,
)

KEY = np.int64(1) << 32  # (document, offset) as one sortable key: offsets in a document stay below 2^32


class TrainedSpans:
    """The trained tokens of one part's documents: `first` [documents], and optionally the gaps as
    ragged arrays (`gap_offsets` [documents + 1] into `gaps`, each document's increasing)."""

    def __init__(self, first: np.ndarray, gap_offsets: np.ndarray | None = None, gaps: np.ndarray | None = None):
        self.first = np.asarray(first, dtype=np.int64)
        self.gaps = None
        if gaps is not None and len(gaps):
            self.gap_offsets, self.gaps = np.asarray(gap_offsets, dtype=np.int64), np.asarray(gaps, dtype=np.int64)
            doc = np.repeat(np.arange(len(self.first)), np.diff(self.gap_offsets))
            self._keys = doc * KEY + self.gaps
            # each gap offset's place in its document's list: even switches training off, odd on again
            nth = np.arange(len(self.gaps)) - self.gap_offsets[doc]
            self._on = nth % 2 == 1
            # trained tokens before each gap offset: a span ends at each even one (it began at `first` or
            # at the odd one before); an odd one has as many before it as the even one before it
            began = np.where(nth == 0, self.first[doc], np.roll(self.gaps, 1))
            span = np.where(self._on, 0, self.gaps - began)
            total = np.cumsum(span)
            # (the cumulative sum restarts at each document: minus what the documents before it hold)
            self._before = total - (total - span)[self.gap_offsets[doc]]

    def _last_gap(self, docs: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(how many of its document's gap offsets are <= `at`, the index of the last of them)."""
        i = np.searchsorted(self._keys, docs * KEY + at, side="right")
        return i - self.gap_offsets[docs], i - 1

    def trained(self, docs, at) -> np.ndarray:
        """Whether token `at` of document `docs` is trained on (elementwise)."""
        docs, at = np.asarray(docs, dtype=np.int64), np.asarray(at, dtype=np.int64)
        on = at >= self.first[docs]
        if self.gaps is None:
            return on
        passed, _ = self._last_gap(docs, at)
        return on & (passed % 2 == 0)

    def before(self, docs, at) -> np.ndarray:
        """How many of document `docs`' tokens before offset `at` are trained on (elementwise)."""
        docs, at = np.asarray(docs, dtype=np.int64), np.asarray(at, dtype=np.int64)
        first = self.first[docs]
        plain = np.maximum(0, at - first)
        if self.gaps is None:
            return plain
        passed, last = self._last_gap(docs, at)
        last = np.maximum(last, 0)  # (only read where passed > 0)
        after = self._before[last] + np.where(self._on[last], at - self.gaps[last], 0)
        return np.where(passed > 0, after, plain)


def part_trained_spans(root: Path, part: dict) -> TrainedSpans | None:
    """Which tokens of the part's documents are trained on (store.LOSS_FROM, LOSS_GAPS), or None where the
    part has neither file (every token of every document is)."""
    firsts, gaps = load_loss_from(root / part["dir"]), load_loss_gaps(root / part["dir"])
    masked, gapped = response_only_documents(part), answer_gap_documents(part)
    if firsts is None and gaps is None and not masked:
        return None
    documents = int(part.get("documents", len(firsts) if firsts is not None else 0))
    # a part copied without them would train on its prompts or user turns: refused, as a part of cut-short samples is
    for path, found, count, what in (
            (root / part["dir"] / LOSS_FROM, firsts, masked, "trained on their responses only"),
            (root / part["dir"] / f"{LOSS_GAPS}.offsets.npy", None if gaps is None else gaps[0][1:], gapped,
             "trained on several answers")):
        if (found is None and count) or (found is not None and len(found) != documents):
            held = "is missing" if found is None else f"holds {len(found):,} documents"
            raise DataError(f"the store '{root}' is damaged: {path} {held}, its manifest {documents:,} ({count:,} "
                            f"{what}); rebuild it.")
    if firsts is None:
        firsts = np.zeros(documents, dtype=np.int64)
    return TrainedSpans(np.asarray(firsts), *(gaps if gaps is not None else (None, None)))


def trained_token_mask(spans: TrainedSpans | None, part: dict, arrays, lo: int, hi: int) -> np.ndarray | None:
    """[samples lo..hi of a part's split, seq_len] bool: their tokens that are trained on (instruction data's
    answers; padding not), by the part's `spans` (part_trained_spans), or None where every real token is."""
    if spans is None:
        return None
    hi = min(hi, len(arrays.pointer) - 1)
    segs = arrays.segments[int(arrays.pointer[lo]):int(arrays.pointer[hi])].astype(np.int64)
    lengths = segs[:, S_LENGTH]
    seg = np.repeat(np.arange(len(segs)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    mask = np.zeros((hi - lo, arrays.tokens.shape[1]), dtype=bool)
    mask[segs[seg, S_SAMPLE] - lo, segs[seg, S_OFFSET] + within] = spans.trained(
        segs[seg, S_DOC] - int(part["first_doc"]), segs[seg, S_START] + within)
    return mask
