"""A generated row's text as its own decoding reads it, from a few of its last tokens: begun on a character (not
inside one), after the prompt's last ids, and with a run of byte-fallback tokens that a stray byte poisons read
whole (the row's decoding has it as U+FFFD). The stop strings (output.py StopStrings) and the terminal stream
(Stream) read a row's text through these, so neither shows nor matches text the JSON line does not hold."""

from __future__ import annotations

import dataclasses

CONTEXT_TOKENS = 8  # the prompt's last ids that --echo decodes a continuation after


def from_character(tokenizer, ids, start: int, end: int, exact: bool = False) -> tuple[int, str]:
    """(s, the text of ids[s:end]) begun on a character as the row's own decoding reads it: the first s of
    start..start + 3 whose text does not begin with U+FFFD (inside a character), else (start, its text); start 0
    is the row's own beginning, kept; and, `exact`, a start in a run of byte tokens that a stray byte poisons
    moves back to the run's first token (poisoned_run: a walk over the run, so the stop check asks it only to
    confirm a match).

    Why: a byte-fallback decoder (tokenizer.json's ByteFallback: Llama's, Mistral's) decodes a run of
    byte tokens that is not valid UTF-8 as one U+FFFD per byte, so a decoding begun inside a character
    turns the whole run into U+FFFD, the complete characters after it too: text the row's decoding does
    not hold (a stop string in the run went unseen; the stream showed U+FFFD for the characters). A
    character is at most 4 bytes, so one of the next 3 starts is a character's first byte. Where the row's
    decoding has the run as U+FFFD itself (a stray byte in it), skipping showed the run's later characters,
    text the row never holds: a stop string matched there ended a row whose line lacks it."""
    poisoned = poisoned_run(tokenizer, ids, start, end) if exact else None
    if poisoned is not None:  # (its U+FFFD are the row's own: nothing to skip)
        return poisoned, tokenizer.decode(ids[poisoned:end])
    first = tokenizer.decode(ids[start:end])
    if start == 0 or not first.startswith("\ufffd"):
        return start, first
    for s in range(start + 1, min(start + 4, end)):
        if exact and poisoned_run(tokenizer, ids, s, end) is not None:
            break  # (the U+FFFD are a poisoned run's, begun after `start`: the row's own)
        text = tokenizer.decode(ids[s:end])
        if not text.startswith("\ufffd"):
            return s, text
    return start, first


def poisoned_run(tokenizer, ids, start: int, end: int) -> int | None:
    """Where ids[start] lies in a run of a ByteFallback decoder's byte tokens (up to `end`) that a byte before
    its last character makes invalid UTF-8 (a stray byte), the run's first token: the row's decoding has the
    whole run as U+FFFD, so no start inside it, on a character or not, reads it as the row does. None
    otherwise, and for a run invalid only for a character its last bytes have not finished: that one decodes
    as U+FFFD from any start (a long run of byte tokens, a script the vocabulary lacks, is then not decoded
    whole each step)."""
    table = getattr(tokenizer, "fallback_bytes", dict)()  # {id: byte}; {} for other decoders
    if not table or not 0 <= start < end:
        return None
    # (special tokens, which decode leaves out before the decoder runs, join the byte tokens around them in a run)
    silent = set(getattr(tokenizer, "special_tokens", dict)().values())

    def in_run(i: int) -> bool:
        return int(ids[i]) in table or int(ids[i]) in silent

    if not in_run(start):
        return None
    first, last = start, start
    while first > 0 and in_run(first - 1):
        first -= 1
    while last < end and in_run(last):
        last += 1
    try:
        bytes(table[int(i)] for i in ids[first:last] if int(i) in table).decode("utf-8")
    except UnicodeDecodeError as e:
        return None if e.reason == "unexpected end of data" else first
    return None


def prompt_context(tokenizer, prompt_ids) -> tuple[list[int], str]:
    """(the prompt's last ids a continuation is decoded after, their text): up to CONTEXT_TOKENS, begun on a
    character, or further back at the first token of a run of byte tokens a stray byte poisons (from_character,
    `exact`): begun inside such a run, its ids decoded as text that the prompt's own decoding has as U+FFFD, and
    the line's text was the run's later bytes as characters where decode(prompt + tokens) less decode(prompt)
    has U+FFFD."""
    n = len(prompt_ids)
    start, head = from_character(tokenizer, prompt_ids, max(0, n - CONTEXT_TOKENS), n, exact=True)
    return [int(t) for t in prompt_ids[start:]], head


def continuation_text(tokenizer, prompt_ids, tokens) -> str:
    """The text `tokens` add after a prompt ending in `prompt_ids`, as transformers' text-generation
    pipeline gives it (the whole decoded, less the prompt's decoding). Decoded alone, a SentencePiece
    decoder (Llama-2, Mistral: its Strip) drops the first space: '▁time' is 'time', and prompt +
    that reads 'Once upon atime'. Plain decoding when the prompt's text is not a prefix of the whole
    (a character split across the boundary)."""
    return text_after(tokenizer, prompt_context(tokenizer, prompt_ids), tokens)


def text_after(tokenizer, context: tuple[list[int], str], tokens) -> str:
    """continuation_text of a prompt whose prompt_context is `context` (found once per prompt)."""
    ids, head = context
    whole = tokenizer.decode([*ids, *tokens])
    return whole[len(head):] if ids and whole.startswith(head) else tokenizer.decode(tokens)


@dataclasses.dataclass
class ByteRun:
    """The run of byte tokens a row's tokens end in, as output.py's StopStrings follows it token by token."""

    tokens: list  # the row's own token list (the decode loop appends to it; another list starts again)
    first: int  # the run's first token
    read: int  # the tokens fed to the decoders so far
    decoders: list  # UTF-8 decoders fed the run's bytes (a second one the prompt's run too, where it joins it)
    poisoned: bool = False  # a stray byte met: the row has the run as U+FFFD a byte, as long as it grows
    bytes: int = 0  # its byte tokens (special ones, which decode leaves out, join a run without a byte)
    before: str | None = None  # the row's text before the run (_held_after_run), read once a run

    def unreadable(self) -> bool:
        """Whether the row has the run as U+FFFD a byte: poisoned, or its last character unfinished (until a byte
        finishes it: 'Question:' + 'A' x 24 + <0xC3> holds ':\ufffd', which a tail begun inside the run never
        read)."""
        return self.poisoned or any(decoder.getstate()[0] for decoder in self.decoders)
