"""The text `longctx generate` streams to a terminal never shows a character that its JSON line
removes (generate/output.py Stream): stop strings that span tokens, sit inside one token with more
text after them, repeat, or begin where a false start of one ended; several stops at once; UTF-8
characters split over byte tokens. The loop below calls the output as the engine does (on_token
first, then the stop check), and the terminal's text is compared with the JSON text exactly."""

import io
import json
import random

import pytest

import longctx.progress
from longctx.data.tokenizer import ByteTokenizer
from longctx.generate.output import Output, StopStrings, safe_end
from longctx.generate.results import Result


class Pieces:
    """A tokenizer whose tokens are whole strings (a token may hold several characters)."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def _stream(tokenizer, ids, stops, monkeypatch, capsys, limit=None):
    """(what the terminal showed, the JSON line's text) for the tokens `ids` generated in that order."""
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    out = io.StringIO()
    output = Output(tokenizer, stops, "", 1, len(ids), main_rank=True)
    output.file = out
    checker = StopStrings(tokenizer, stops) if stops else None
    tokens, reason = [], "length"
    for t in ids[:limit]:
        tokens.append(t)
        output.on_token(0, t)  # the engine's order: the token is streamed, then the stop is checked
        if checker is not None and checker(0, tokens):
            reason = "stop"
            break
    output.write({"text": "p"}, Result(1, tokens, reason, 1.0, 1.0), speculative=False)
    shown = capsys.readouterr().err
    assert shown.endswith("\n")
    return shown[:-1], json.loads(out.getvalue())["text"], reason


def test_issue_example_byte_tokenizer(monkeypatch, capsys):
    tok = ByteTokenizer()
    ids = [int(t) for t in tok.encode("hello END and more")]
    shown, text, reason = _stream(tok, ids, ["END"], monkeypatch, capsys)
    assert (shown, text, reason) == ("hello ", "hello ", "stop")


@pytest.mark.parametrize("pieces, stops, want", [
    (["hel", "lo E", "ND more"], ["END"], "hello "),          # spans tokens
    (["hello ", "xxENDyy", "zz"], ["END"], "hello xx"),       # inside one token, text after it
    (["a", "EN", "x", "E", "N", "D", "b"], ["END"], "aENx"),  # a false start, then the stop
    (["ab", "ab", "ab"], ["bab"], "a"),                       # overlapping repeats of the stop
    (["x", "\n", "\n", "y"], ["\n\n", "y"], "x"),             # several stops, the first found wins
    (["one ", "two"], ["END"], "one two"),                     # no stop: the whole text
])
def test_pieces(pieces, stops, want, monkeypatch, capsys):
    shown, text, _ = _stream(Pieces(pieces), list(range(len(pieces))), stops, monkeypatch, capsys)
    assert text == want
    assert shown == text


def test_utf8_characters_over_several_byte_tokens(monkeypatch, capsys):
    tok = ByteTokenizer()
    ids = [int(t) for t in tok.encode("café ÉND é END")]
    shown, text, _ = _stream(tok, ids, ["ÉND", "é END"], monkeypatch, capsys)
    assert shown == text == "café "


def test_random_scripts(monkeypatch, capsys):
    """Random token scripts over fragments of the stops: the terminal equals the JSON every time."""
    rng = random.Random(0)
    fragments = ["E", "N", "D", "EN", "ND", "END", "xE", "Dx", "a", " ", "NDE", "\n", "\n\n", "ab"]
    for trial in range(300):
        stops = rng.sample(["END", "\n\n", "DEN", "bab", "ENDE"], rng.randint(1, 3))
        ids = [rng.randrange(len(fragments)) for _ in range(rng.randint(1, 12))]
        shown, text, _ = _stream(Pieces(fragments), ids, stops, monkeypatch, capsys)
        assert shown == text, (trial, stops, [fragments[i] for i in ids])


def test_safe_end_holds_back_only_a_possible_start():
    assert safe_end("hello E", ["END"]) == len("hello ")
    assert safe_end("hello EN", ["END"]) == len("hello ")
    assert safe_end("hello ENx", ["END"]) == len("hello ENx")  # no longer a start: all of it shows
    assert safe_end("hello", ["END"]) == 5
    assert safe_end("abEND!", ["END"]) == 2


class LeadingSpaceDropped(Pieces):
    """A SentencePiece-like decoder: a decoding drops its first space ('▁time' alone is 'time'), so a
    token's text depends on what is decoded before it."""

    def decode(self, ids):
        text = super().decode(ids)
        return text[1:] if text.startswith(" ") else text


class CountingBytes(ByteTokenizer):
    """The byte tokenizer, counting the ids it is asked to decode."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_random_scripts_context_dependent_decoder(monkeypatch, capsys):
    """Tokens whose text depends on the tokens before them, and UTF-8 characters split over byte tokens:
    the terminal still equals the JSON text, which decodes the row whole."""
    rng = random.Random(1)
    fragments = [" E", "N", "D", " ", "a", " b", "END", "\n", " \n"]
    for trial in range(300):
        stops = rng.sample(["END", "\n\n", " b", "a E"], rng.randint(1, 2))
        ids = [rng.randrange(len(fragments)) for _ in range(rng.randint(1, 14))]
        shown, text, _ = _stream(LeadingSpaceDropped(fragments), ids, stops, monkeypatch, capsys)
        assert shown == text, (trial, stops, [fragments[i] for i in ids])
    tok = ByteTokenizer()
    for trial in range(200):
        chars = "".join(rng.choice(["é", "a", "€", "𝄞", " ", "E", "N", "D"]) for _ in range(rng.randint(1, 12)))
        stops = rng.sample(["END", "é€", "𝄞 "], rng.randint(1, 2))
        shown, text, _ = _stream(tok, [int(t) for t in tok.encode(chars)], stops, monkeypatch, capsys)
        assert shown == text, (trial, stops, chars)


def test_stream_work_per_token_does_not_grow_with_the_text(capsys):
    """Streaming n tokens decodes O(n) ids in all, not the whole row at every token (O(n^2): 2M ids at
    n = 2,000), and shows the whole text."""
    from longctx.generate.output import Stream

    tok = CountingBytes()
    ids = [int(t) for t in tok.encode("longctx streams text é€ " * 100)][:2000]
    stream = Stream(tok, ["STOP"])
    for t in ids:
        stream(0, t)
    assert tok.decoded < 40 * len(ids), tok.decoded
    stream.finish(ByteTokenizer().decode(ids))
    assert capsys.readouterr().err == ByteTokenizer().decode(ids) + "\n"
