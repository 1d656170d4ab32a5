"""Which tokens of a store's documents are trained on (instruction data: the answers, not the prompts).

Per document, training switches on and off at token offsets: off before `first` (store.LOSS_FROM; 0 for
a plain document, every token trained), on from it, then off and on again at each of its `gaps`
(store.LOSS_GAPS: a conversation's user turns between two answers, `off, on, off, on, ...`, an even
number of offsets after `first`); the last span trained runs to the document's end, its EOS included.
A part with no gaps file has none in any document, and the two queries below are one formula each.

Both queries take arrays of (document, offset) pairs, so the loader asks them for every segment of a
part at once (its label counts) or for every token of a sample (its label mask) without a Python loop.
"""

from __future__ import annotations

import numpy as np

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
