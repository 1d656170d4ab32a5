"""A stop string is found whatever tokens that decode to nothing lie inside it (generate/output.py
StopStrings): special tokens that decode skips (kept under --ignore-eos), or a byte tokenizer's ids
>= 256 (its BOS and EOS). The check reads only a tail of the row's tokens; the tail must hold enough
text, not only enough tokens. And it fires at the first token whose text contains the stop, as
checking the whole text every time would."""

import random

import pytest

from longctx.data.tokenizer import ByteTokenizer
from longctx.generate.output import StopStrings


class Pieces:
    """A tokenizer whose tokens are whole strings ('' for a token that decodes to nothing)."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def _fired(stops: StopStrings, tokens: list[int]) -> int | None:
    """The number of tokens after which the check first says stop (as the decode loop calls it)."""
    return next((n for n in range(1, len(tokens) + 1) if stops(0, tokens[:n])), None)


def _first_in_text(tokenizer, stops: list[str], tokens: list[int]) -> int | None:
    return next((n for n in range(1, len(tokens) + 1) if any(s in tokenizer.decode(tokens[:n]) for s in stops)),
                None)


@pytest.mark.parametrize("silent", [1, 11, 40, 300])
def test_special_tokens_inside_the_stop(silent):
    """'x', then silent tokens (e.g. end-of-text under --ignore-eos), then ':': the stop 'x:' is in the text."""
    tok = Pieces(["x", "", ":", "tail text after the stop"])
    tokens = [0] + [1] * silent + [2]
    assert tok.decode(tokens) == "x:"
    assert _fired(StopStrings(tok, ["x:"]), tokens) == len(tokens)
    # the last token also holding more text after the stop: still found
    tokens = [0] + [1] * silent + [2, 3]
    assert _fired(StopStrings(tok, ["x:"]), tokens) == silent + 2
    tok2 = Pieces(["x", "", ":and a long run of text in the very token that completes the stop"])
    assert _fired(StopStrings(tok2, ["x:"]), [0] + [1] * silent + [2]) == silent + 2


def test_byte_tokenizer_bos_and_eos_ids_inside_the_stop():
    tok = ByteTokenizer()
    tokens = [int(t) for t in tok.encode("a END")]
    tokens = tokens[:3] + [tok.eos_id] * 20 + [tok.bos_id] * 5 + tokens[3:] + [int(t) for t in tok.encode("!")]
    assert "END" in tok.decode(tokens)
    assert _fired(StopStrings(tok, ["END"]), tokens) == len(tokens) - 1


def test_random_scripts_fire_where_the_whole_text_first_holds_a_stop():
    """Random scripts over fragments of the stops, silent tokens and long pieces: the check fires at the
    first token whose whole text contains a stop (no earlier, no later), as before for scripts without
    silent tokens."""
    rng = random.Random(0)
    pieces = ["E", "N", "D", "EN", "ND", "END", "xE", "Dx", "a", " ", "", "", "", "long piece of text " * 3,
              "\n", "\n\n", "é"]
    tok = Pieces(pieces)
    for _ in range(300):
        stops = rng.choice([["END"], ["\n\n"], ["END", "é\n"], ["NDx a"]])
        tokens = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 80))]
        assert _fired(StopStrings(tok, stops), tokens) == _first_in_text(tok, stops, tokens), (stops, tokens)
