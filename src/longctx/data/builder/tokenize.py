"""Batched, parallel tokenisation of documents, with the natural cut points packing needs.

Each document becomes the tokenizer's own prefix (`text_prefix`: Llama's BOS; none for the byte
tokenizer and many others), its tokens and one EOS (the document's `length` counts all three), plus two
sorted arrays of token offsets where the document could be cut if it is longer than a sample:
`breaks` (a token that starts a new line) and `strong` (a new line after a blank line: a new
paragraph, or a new top-level definition in source code). The byte tokenizer finds them from the
bytes directly; Hugging Face tokenizers from the encodings' character offsets. Hugging Face
tokenizers run their own thread pool over each batch (RAYON_NUM_THREADS = workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

NEWLINE = 10


@dataclass
class Tokenized:
    tokens: list[np.ndarray]  # per document, prefix and EOS included
    breaks: list[np.ndarray]
    strong: list[np.ndarray]

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(t) for t in self.tokens), dtype=np.int64, count=len(self.tokens))


def _byte_breaks(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nl = ids == NEWLINE
    breaks = np.flatnonzero(nl[:-1]) + 1
    strong = np.flatnonzero(nl[1:-1] & nl[:-2]) + 2
    return breaks, strong


def _offset_breaks(text: str, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token i starts a new line when a newline lies between token i-1's start and token i's start."""
    if len(starts) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    cum = np.concatenate([[0], np.cumsum(chars == NEWLINE)])  # newlines before char position
    before = cum[np.clip(starts, 0, len(chars))]
    step = np.diff(before)
    breaks = np.flatnonzero(step >= 1) + 1
    strong = np.flatnonzero(step >= 2) + 1
    return breaks, strong


def tokenize_one(text: str, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix + tokens + EOS, breaks, strong) of one document."""
    return next(iter(_tokenized([text], tok)))


def tokenize_answers(text: str, trained_chars, tok,
                     prefix: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(prefix + tokens + EOS, breaks, strong, switches) of instruction data: `text` trained on from
    character `trained_chars[0]` (an instruction pair's response, a conversation's first answer), then
    off and on again at each later offset (a conversation's user turns between its answers), the last
    span to the end. Encoded as the model reads and writes it at inference:
    - the prompt (the text before the first answer), its special-token strings read as special tokens
      (a chat template's `<|im_start|>`, as `longctx generate` encodes a prompt); the tokenizer's prefix
      (BOS) put before it unless the prompt begins with it already, or `prefix` is False (a conversation
      rendered by a chat template: as transformers' apply_chat_template, only what the template writes);
    - the rest as the whole text's ids, where the whole text's begin with the ids of the text up to each
      switch (the usual case: the ids of the text read whole, as transformers' apply_chat_template gives
      them); else, where a token would straddle a switch ("\n" + "\n" merged, say), each piece between
      two switches apart, as it reads after other text (`_piece`): what the model writes after the prompt's
      ids. (The prompt is encoded alone; the text up to a later switch only from the last added token
      before it, `_switch_at`: linear in the text, not in its switches times its length);
    - `switches`: the token offsets where training starts and stops; the first is where it starts
      (store.LOSS_FROM), the others the gaps (store.LOSS_GAPS); the last span runs on to the EOS. Each
      switch is a break.
    A text whose ids end with the EOS (a chat template that writes eos_token after the last answer) keeps that one
    as the document's EOS: one EOS, as for any document."""
    bounds = [int(c) for c in trained_chars]
    p_ids, pb, ps = _piece(text[:bounds[0]], tok, after_text=False)
    own = np.asarray(tok.text_prefix() if prefix else [], dtype=np.int32)
    lead = own if len(own) and not np.array_equal(p_ids[:len(own)], own) else own[:0]
    byte = getattr(tok, "name", "") == "byte"
    w_ids, wb, ws, w_enc = (*_piece(text, tok, after_text=False), None) if byte else _encoding(text, tok)
    ats = [len(p_ids) if np.array_equal(w_ids[:len(p_ids)], p_ids) else None]
    anchors = _added_tokens(text, tok, w_ids, w_enc) if len(bounds) > 1 else None
    for c in bounds[1:]:
        if ats[-1] is None:
            break  # (one straddled switch: every piece is encoded apart)
        ats.append(_switch_at(text, c, tok, w_ids, anchors))
    if None not in ats:
        ids, breaks, strong = w_ids, wb, ws
    else:
        pieces = [(p_ids, pb, ps)] + [_piece(text[a:b], tok, after_text=True)
                                      for a, b in zip(bounds, [*bounds[1:], len(text)])]
        starts = np.cumsum([0] + [len(piece[0]) for piece in pieces])
        ats = starts[1:-1].tolist()
        ids = np.concatenate([piece[0] for piece in pieces])
        breaks = np.concatenate([piece[1] + at for piece, at in zip(pieces, starts)])
        strong = np.concatenate([piece[2] + at for piece, at in zip(pieces, starts)])
    if len(ids) and int(ids[-1]) == tok.eos_id:
        # the text ends with the EOS already (a template that closes each answer with eos_token: Llama-2's, Mistral's):
        # that one is the document's EOS, not followed by another (the model would be trained on EOS after EOS)
        ids, breaks, strong = ids[:-1], breaks[breaks < len(ids) - 1], strong[strong < len(ids) - 1]
    n = len(lead)
    switches = np.asarray(ats, dtype=np.int64) + n
    breaks = np.unique(np.concatenate([breaks + n, switches[switches > 0]])).astype(np.int64)
    tokens = np.concatenate([lead, ids, np.array([tok.eos_id], dtype=np.int32)])
    return tokens, breaks, (strong + n).astype(np.int64), switches


def _added_tokens(text: str, tok, w_ids: np.ndarray, enc=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index, first character, end character) of each added token matched before normalisation in the whole
    text's ids `w_ids` (its Encoding `enc`, encoded here if not given), in order: the tokenizer reads the text
    between two of them apart."""
    added = getattr(tok, "added_ids", lambda: frozenset())()
    if not added:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    enc = enc if enc is not None else tok.encode_encodings([text], special_tokens=True)[0]
    at = np.flatnonzero(np.isin(w_ids, list(added)))
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    return at, offsets[at, 0], offsets[at, 1]


def _switch_at(text: str, c: int, tok, w_ids: np.ndarray, anchors) -> int | None:
    """The length of the ids of text[:c], where they are the whole text's first ones (else None: a token of
    the whole straddles character c). Encoded from the last added token that ends by c (its index i in
    the whole's ids, its first character s): what lies before it is read apart from what follows in both,
    so the ids of text[:c] are the whole's first i and then those of text[s:c]."""
    index, first, end = anchors
    k = int(np.searchsorted(end, c, side="right")) - 1
    i, s = (int(index[k]), int(first[k])) if k >= 0 else (0, 0)
    ids = _piece(text[s:c], tok, after_text=False)[0]
    if np.array_equal(w_ids[i:i + len(ids)], ids):
        return i + len(ids)
    if s:  # (not a prefix locally: confirmed on the whole prefix, once a document, before the pieces go apart)
        ids = _piece(text[:c], tok, after_text=False)[0]
        return len(ids) if np.array_equal(w_ids[:len(ids)], ids) else None
    return None


# text a piece is encoded after (the first whose own ids stay a prefix). (Latent: a pre-tokenizer that groups
# the probe with what follows, "1" + "2345" as digits in threes, can pass that check with other groups than the
# piece's own; a vocabulary of all 3-digit numbers, as Llama-3's, falls back to the next probe there.)
PIECE_PROBES = ("1", "a", ".")


def _piece(text: str, tok, after_text: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, breaks, strong) of one piece of a pair, special-token strings read as special tokens, no
    prefix or EOS. `after_text`: as the piece reads after other text, encoded after a probe whose ids
    are dropped: encoded alone, a Llama-2 / Mistral tokenizer.json (its normalizer's Prepend('▁')) starts
    it with a word boundary of its own, '▁▁there' for " there" (data/synthetic.py _encode does the same
    for an answer). Plain encoding where no probe's ids stay a prefix (the piece merged with each)."""
    if getattr(tok, "name", "") == "byte":
        ids = tok.encode(text)
        return (ids, *_byte_breaks(ids)) if len(ids) else (ids, np.zeros(0, np.int64), np.zeros(0, np.int64))
    for probe in PIECE_PROBES if after_text else ():
        own = tok.encode_encodings([probe], special_tokens=True)[0].ids
        enc = tok.encode_encodings([probe + text], special_tokens=True)[0]
        if enc.ids[:len(own)] == own:
            breaks, strong = _offset_breaks(probe + text, np.asarray([o[0] for o in enc.offsets], dtype=np.int64))
            n = len(own)
            return (np.asarray(enc.ids[n:], dtype=np.int32), breaks[breaks > n] - n, strong[strong > n] - n)
    return _encoding(text, tok)[:3]


def _encoding(text: str, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray, object]:
    """(ids, breaks, strong, the library's Encoding) of a text read whole by a Hugging Face tokenizer,
    special-token strings as special tokens."""
    enc = tok.encode_encodings([text], special_tokens=True)[0]
    breaks, strong = _offset_breaks(text, np.asarray([o[0] for o in enc.offsets], dtype=np.int64))
    return np.asarray(enc.ids, dtype=np.int32), breaks, strong, enc


def _tokenized(texts: list[str], tok):
    """(prefix + tokens + EOS, breaks, strong) per text, in order; the cut points count the prefix."""
    eos = np.array([tok.eos_id], dtype=np.int32)
    if getattr(tok, "name", "") == "byte":
        for text in texts:
            ids = tok.encode(text)
            yield (np.concatenate([ids, eos]), *_byte_breaks(ids))
        return
    prefix = np.asarray(tok.text_prefix(), dtype=np.int32)
    for text, enc in zip(texts, tok.encode_encodings(texts)):
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        breaks, strong = _offset_breaks(text, starts)
        yield (np.concatenate([prefix, ids, eos]), breaks + len(prefix), strong + len(prefix))


def tokenize(texts: list[str], tok, workers: int = 1, batch: int = 256, progress=None) -> Tokenized:
    if getattr(tok, "name", "") != "byte":
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, workers)))
    tokens, breaks, strong = [], [], []
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        for t, b, s in _tokenized(chunk, tok):
            tokens.append(t)
            breaks.append(b)
            strong.append(s)
        if progress is not None:
            progress.update(len(chunk))
    return Tokenized(tokens, breaks, strong)
