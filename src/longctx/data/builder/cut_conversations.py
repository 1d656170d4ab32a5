"""Conversations longer than a sample, cut after an answer (`longctx data build --long-conversations
truncate`, the default): where each is cut (conversations.py turn_cut, over the scan's gaps), and the text,
switches, exact hash and MinHash signature of what is stored, the shorter conversation it becomes (its
rendering is the long one's prefix), so that dedup and a later append compare what the store holds. The
assembly (assembly.py) shortens their lengths and the part writer (part_writer.py) writes their EOS and
their gaps before the cut."""

from __future__ import annotations

import numpy as np

from .conversations import turn_cut
from .dedup import instruction_hash, instruction_parts, signature
from .scan import ScannedCorpus


def turn_cuts(corpus: ScannedCorpus, docs: np.ndarray, seq_len: int, eos_id: int | None = None) -> dict[int, int]:
    """{corpus document: where it is cut} for the conversations `docs` (sorted) that can be cut at a turn. An
    answer that ends with the EOS already (a template that writes eos_token after each answer: Llama-2's,
    Mistral's) is cut before it, so that the EOS written at the cut is that one, not a second (`eos_id`)."""
    cuts, order = {}, iter(docs.tolist())

    def own_eos(doc: int, cut: int) -> bool:  # (the answer cut after ends with the EOS itself)
        return cut > 0 and eos_id is not None and int(corpus.get("tokens", doc, cut - 1, cut)[0]) == eos_id

    for shard, rows in corpus.kept_in_shards(docs):  # (shard by shard, in document order)
        offsets, values = shard.gaps(rows)
        for i, doc in zip(range(len(rows)), order):
            gaps = values[offsets[i]:offsets[i + 1]]
            # (an answer ending at seq_len fits where its own EOS is the one written at the cut: as long as the
            # shorter conversation stored alone, which fits)
            cut = turn_cut(gaps, seq_len + 1)
            if cut == seq_len and not own_eos(doc, cut):
                cut = turn_cut(gaps, seq_len)
            if own_eos(doc, cut):
                cut -= 1
            if cut:
                cuts[doc] = cut
    return cuts


def cut_view(corpus: ScannedCorpus, eos_at: dict[int, int], doc: int, closing: str = "") -> tuple[str, np.ndarray]:
    """(text, trained_chars) of corpus document `doc`, cut after an answer (`eos_at`), as stored: the shorter
    conversation it becomes. `closing`: the EOS's text, which a template that writes it after the last message
    only (Phi-3's) ends the shorter conversation's rendering with, as it ends the whole one's."""
    text, chars, cut = corpus.text(doc), np.asarray(corpus.get("chars", doc), np.int64), eos_at[doc]
    # (gaps: the switches after the first; the answer's end is the cut, or one past it where the answer's own
    # EOS is the one written at the cut: turn_cuts)
    k = int(np.flatnonzero(np.asarray(corpus.get("gaps", doc)) >= cut)[0]) + 1
    short = text[:int(chars[k])]
    if closing and text.endswith(closing) and not short.endswith(closing):
        short += closing
    return short, chars[:k]


def cut_hashes(corpus: ScannedCorpus, eos_at: dict[int, int], minhash: bool,
               closing: str = "") -> dict[int, tuple[int, np.ndarray | None]]:
    """{corpus document: (exact hash, MinHash signature or None)} of the cut conversations, as a scan of the
    shorter conversation makes them (shard_files.py)."""
    out = {}
    for doc in eos_at:
        text, chars = cut_view(corpus, eos_at, doc, closing)
        sig = signature(instruction_parts(text, chars)[1]).astype(np.uint32) if minhash else None
        out[doc] = (instruction_hash(text, chars), sig)
    return out


def eos_text(tokenizer) -> str:
    """The EOS's text (its special token's string), or "" for a tokenizer that names none (the byte one)."""
    specials = getattr(tokenizer, "special_tokens", lambda: {})()
    return next((text for text, i in specials.items() if i == tokenizer.eos_id), "")
