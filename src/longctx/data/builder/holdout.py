"""Which documents, or pieces of documents, are held out as the eval split.

A document is held out when the hash of its name says so: stable when documents are added or
removed, and the same rule the trainer has always used. A document longer than the holdout length
(BuildOptions.holdout_len: --holdout-tokens, else the sample's seq_len) is cut into pieces of about
that length (pack.py `cut_points`) and each piece is held out by the hash of `name#piece`: otherwise
a corpus of long documents (a few books, a repository's largest files) leaves the eval split empty
even though most of its tokens could have gone there. The pieces depend on the holdout length alone,
so stores of one corpus at several sequence lengths built with the same one (a staged run's: its
longest stage) hold out the same text; at their own seq_len, most of one length's eval text would be
another's training text. When the hash
holds out nothing at all, the piece with the lowest hash is (`split_items`), so an eval fraction
above 0 always gives an eval split unless the corpus is a single piece. An append holds out a revision of
that document (the same name) the same way, at the offset its first version's held-out part starts
(fallback_parts.py), whatever its own pieces' hashes hold out besides: a document's revision is held out
as its first version was.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field

import numpy as np

from .pack import cut_points
from .scan import ScannedCorpus

# where a kept document went (the store's docs.jsonl says it as SPLIT_OF[where])
IN_TRAIN, IN_EVAL, IN_BOTH = 0, 1, 2
SPLIT_OF = ("train", "eval", "both")


def _name_bytes(name: str) -> bytes:
    """A name's bytes: UTF-8, and a file name's undecodable bytes as they are on disk (Python reads such a
    name with surrogateescape; a plain .encode() fails on it)."""
    return name.encode("utf-8", "surrogateescape")


def is_eval_doc(name: str, eval_fraction: float) -> bool:
    return zlib.crc32(_name_bytes(name)) % 1_000_000 < eval_fraction * 1_000_000


def piece_name(name: str, piece: int) -> str:
    return f"{name}#{piece}"


def eval_rank(name: str) -> int:
    """The hash `is_eval_doc` compares: the lowest one is the first to be held out."""
    return zlib.crc32(_name_bytes(name)) % 1_000_000


@dataclass
class Items:
    """What one split packs: (document, start, length) items in document order."""
    doc: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)

    def add(self, d: int, s: int, n: int) -> None:
        self.doc.append(d)
        self.start.append(s)
        self.length.append(n)

    def extend(self, d: int, s: int, n: int) -> None:
        """Add [s, s + n) of document d, as part of the last item when it ends where this starts: the
        consecutive pieces of a long document on one side of the split stay one run of text (concat
        cuts it only where samples end; bfd and datasculpt cut it again at the same cut points)."""
        if self.doc and self.doc[-1] == d and self.start[-1] + self.length[-1] == s:
            self.length[-1] += n
        else:
            self.add(d, s, n)

    def arrays(self):
        return (np.asarray(self.doc, np.int64), np.asarray(self.start, np.int64), np.asarray(self.length, np.int64))


def split_items(corpus: ScannedCorpus, kept: np.ndarray, names: list[str], lengths: np.ndarray, piece_len: int,
                eval_fraction: float, log, seq_len: int = 0, fallback: bool = True,
                held_out: dict[str, int] | None = None) -> tuple[dict[str, Items], np.ndarray, dict]:
    """Train and eval items, and per kept document where it went (IN_TRAIN, IN_EVAL or IN_BOTH:
    pieces in each). Items name a document by its index in `kept`. Pieces of `piece_len` (the holdout
    grid); when the hash holds out none, the lowest-hash one's sample-sized part (`seq_len`, 0 = the
    grid): a few long documents do not lose a whole one to the eval split. Not with `fallback` False (an
    append to a store that has an eval split: its documents stay where their names put them, so a revision of
    a document the store trains on never becomes eval text). A document named in `held_out` (the store's
    fallback_parts.fallback_starts: its revision) is held out that way too, at the piece holding the offset its
    first version's held-out part starts at, else the store trains on a copy of its eval text."""
    held_out = held_out or {}
    seq_len = seq_len or piece_len
    revisions = []  # (document, its piece holding the first version's held-out start) of those named in held_out
    items = {"train": Items(), "eval": Items()}
    where = np.zeros(len(kept), dtype=np.int8)
    lowest = None  # (hash rank, document, piece) of the first candidate for the eval split
    pieces_total = 0
    for doc, (scanned, name, length) in enumerate(zip(kept.tolist(), names, lengths.tolist())):
        if length <= piece_len or eval_fraction == 0:
            pieces = [(0, length, name)]
        else:
            cuts = _cuts(corpus, scanned, length, piece_len)
            pieces = [(a, b - a, piece_name(name, p)) for p, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
        pieces_total += len(pieces)
        held = [is_eval_doc(piece, eval_fraction) for _, _, piece in pieces] if eval_fraction else [False]
        if eval_fraction:
            rank, first = min((eval_rank(piece), p) for p, (_, _, piece) in enumerate(pieces))
            if lowest is None or rank < lowest[0]:
                lowest = (rank, doc, first)
            if name in held_out:
                revisions.append((doc, bisect.bisect_right([a for a, _, _ in pieces], held_out[name]) - 1))
        if all(h == held[0] for h in held):
            items["eval" if held[0] else "train"].add(doc, 0, length)
            where[doc] = IN_EVAL if held[0] else IN_TRAIN
        else:
            for (start, size, _), h in zip(pieces, held):
                items["eval" if h else "train"].extend(doc, start, size)
            where[doc] = IN_BOTH
    items = _hold_revisions(items, where, revisions, corpus, kept, names, lengths, piece_len, seq_len, log)
    info = {"pieces": pieces_total}
    if eval_fraction and not items["eval"].doc and not fallback:
        log("  eval split: none of the appended documents hashed into it; the store's earlier parts hold it.")
    elif eval_fraction and not items["eval"].doc:
        if len(kept) < 2 and (not len(kept) or lengths[0] <= seq_len):
            log(f"  eval split: empty. --eval-fraction {eval_fraction} asks for held-out text, but the corpus is "
                f"one piece of at most {seq_len} tokens after dedup, which training needs; add documents or pass "
                f"--eval-fraction 0.")
            info["eval_empty"] = "one piece only"
        else:  # the hash put nothing in it: hold out the piece with the lowest hash
            _, doc, piece = lowest
            long = lengths[doc] > seq_len
            items = _move_to_eval(items, doc, piece, corpus, int(kept[doc]), int(lengths[doc]), piece_len, seq_len)
            where[doc] = IN_BOTH if long else IN_EVAL
            log(f"  eval split: no document or piece hashed into it at --eval-fraction {eval_fraction}; held out "
                f"the one with the lowest hash ({names[doc]}{', a sample-sized part of it' if long else ''}).")
            info["eval_fallback"] = names[doc]
    return items, where, info


def _cuts(corpus: ScannedCorpus, scanned: int, length: int, piece_len: int) -> list[int]:
    """The piece boundaries of scanned document `scanned` (pack.cut_points at its line breaks)."""
    return cut_points(length, piece_len, corpus.get("breaks", scanned).astype(np.int64),
                      corpus.get("strong", scanned).astype(np.int64))


def _hold_revisions(items: dict[str, Items], where: np.ndarray, revisions: list[tuple[int, int]],
                    corpus: ScannedCorpus, kept: np.ndarray, names: list[str], lengths: np.ndarray, piece_len: int,
                    seq_len: int, log) -> dict[str, Items]:
    """The items with each (document, piece) of `revisions` held out as the fallback holds a piece out (`where`
    updated). Also where the revision's own hash holds out some other piece of it: skipping those trained on the
    part at the first version's held-out offset, a copy of the store's own eval text."""
    for doc, piece in revisions:
        trained = _trained_tokens(items, doc)
        items = _move_to_eval(items, doc, piece, corpus, int(kept[doc]), int(lengths[doc]), piece_len, seq_len)
        left = _trained_tokens(items, doc)
        where[doc] = IN_BOTH if left else IN_EVAL
        if left < trained:
            log(f"  eval split: held out {names[doc]}, as the store's eval split holds its earlier version")
    return items


def _trained_tokens(items: dict[str, Items], doc: int) -> int:
    """The tokens of document `doc` in the train items (its items are consecutive: document order)."""
    train = items["train"]
    lo = bisect.bisect_left(train.doc, doc)
    return sum(train.length[lo:bisect.bisect_right(train.doc, doc)])


def _move_to_eval(items: dict[str, Items], doc: int, piece: int, corpus: ScannedCorpus, scanned: int, length: int,
                  piece_len: int, seq_len: int) -> dict[str, Items]:
    """The items with the sample-sized part of piece `piece` of document `doc` where it starts (all of
    the document if it fits a sample) in eval, which it joins in document order: what of that part the train
    items held moves (a part the hash holds out already, whole or in part, is not held out twice)."""
    start = 0 if length <= piece_len else _cuts(corpus, scanned, length, piece_len)[piece]
    if length <= seq_len:  # (also a document cut into pieces by a grid shorter than a sample: all of it)
        start, size = 0, length
    else:
        cuts = _cuts(corpus, scanned, length, seq_len)
        i = bisect.bisect_right(cuts, start) - 1  # the sample-sized part holding `start`
        start, size = cuts[i], cuts[i + 1] - cuts[i]
    end = start + size
    train, moved = Items(), []
    for d, s, m in zip(items["train"].doc, items["train"].start, items["train"].length):
        if d != doc or s + m <= start or s >= end:
            train.add(d, s, m)
            continue
        # a train item of document `doc` overlapping the held-out part: keep what lies outside it
        if s < start:
            train.add(d, s, start - s)
        moved.append((d, max(s, start), min(s + m, end) - max(s, start)))
        if end < s + m:
            train.add(d, end, s + m - end)
    held_out = Items()
    for d, s, m in sorted([*zip(items["eval"].doc, items["eval"].start, items["eval"].length), *moved]):
        held_out.extend(d, s, m)
    return {"train": train, "eval": held_out}
