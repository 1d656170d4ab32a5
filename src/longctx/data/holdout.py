"""Which documents, or pieces of documents, are held out as the eval split.

A document is held out when the hash of its name says so: stable when documents are added or
removed, and the same rule the trainer has always used. A document longer than a sample is cut
into sample-sized pieces (pack.py `split_points`) and each piece is held out by the hash of
`name#piece`: otherwise a corpus of long documents (a few books, a repository's largest files)
leaves the eval split empty even though most of its tokens could have gone there.
"""

from __future__ import annotations

import zlib


def is_eval_doc(name: str, eval_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 1_000_000 < eval_fraction * 1_000_000


def piece_name(name: str, piece: int) -> str:
    return f"{name}#{piece}"


def eval_rank(name: str) -> int:
    """The hash `is_eval_doc` compares: the lowest one is the first to be held out."""
    return zlib.crc32(name.encode()) % 1_000_000
