"""Stop strings under a byte-fallback tokenizer (Llama-2's and Mistral's tokenizer.json: pieces, and byte tokens
<0x00>..<0xFF> for what the vocabulary lacks, '\\n' among them). Its ByteFallback decoder reads a run of byte
tokens as one: a run that is not valid UTF-8 decodes as one U+FFFD per byte, its valid characters too. So a
stray byte (a sampled <0xE6> without the rest of its character) turns the bytes after it in its run into U+FFFD
in the row's text, the text the JSON line holds.

The stop check reads only the row's last tokens, decoded from a start that skipped up to 3 leading tokens when
the decoding began with U+FFFD (output.py from_character: for a start inside a character). Begun right after a
stray byte, that decoding showed the run's later bytes as text ("\\n\\n") that the row's text never holds, and
the row ended there: finish_reason "stop", its text cut nowhere, shorter than its limit for no stop string in it.
Now a match is confirmed on a tail that begins where the row's decoding reads: inside a run a stray byte poisons
(special tokens, which decode leaves out, join the byte tokens around them in one run), at the run's first token.
Found by a fuzz of random rows (pieces, byte runs, stray bytes, special tokens) against the whole row's text:
about 3 rows in 3,000 before, none in 42,000 after."""

import pytest

tokenizers = pytest.importorskip("tokenizers")

from longctx.data.tokenizer import HFTokenizer  # noqa: E402
from longctx.generate.output import StopStrings, continuation_text  # noqa: E402

PIECES = ["▁", "Question:", "▁what?", "Answer:", "▁yes", "▁no"]


def _llama_like(path):
    """A tiny tokenizer.json with Llama-2's normaliser and decoder (ByteFallback): every byte, then PIECES."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({p: 256 + i for i, p in enumerate(PIECES)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return HFTokenizer(path), {p: 256 + i for i, p in enumerate(PIECES)}


@pytest.fixture(params=["bytes", "a special token inside"])
def row(tmp_path, request):
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    prompt = [ids["▁"], ids["Question:"], ids["▁what?"]]
    # " Answer: yes", a stray first byte of a 3-byte character, a blank line in byte tokens (one run with the
    # stray byte, a special token among them or not), then more text
    inside = [tok.special_tokens()["</s>"]] if request.param != "bytes" else []
    tokens = [ids["▁"], ids["Answer:"], ids["▁yes"], 0xE6, *inside, 0x0A, 0x0A,
              *[ids["Answer:"], ids["▁no"], ids["▁yes"]] * 4]
    return tok, prompt, tokens


def test_a_stop_string_after_a_stray_byte_ends_no_row_whose_text_lacks_it(row):
    tok, prompt, tokens = row
    text = continuation_text(tok, prompt, tokens)
    assert "\n" not in text and "\ufffd\ufffd\ufffd" in text  # (the run [E6, 0A, 0A]: three U+FFFD)
    stops = StopStrings(tok, ["\n\n"])
    stops.rows([prompt])
    ended = [n for n in range(1, len(tokens) + 1) if stops(0, tokens[:n])]
    assert ended == [], f"the row ended at token {ended[0]} on a stop string its text does not hold: {text!r}"


def test_the_tail_still_reads_a_character_its_window_begins_inside(row):
    """The case the skip was made for stays: a valid character split by the tail's start (its lead byte before
    the window) is read whole, and a stop string after it is seen."""
    tok, prompt, _ = row
    euro = list("€".encode())  # 3 byte tokens
    tokens = [*[256 + PIECES.index("▁yes")] * 3, *euro * 6, 0x0A, 0x0A]
    text = continuation_text(tok, prompt, tokens)
    assert text.endswith("€" * 6 + "\n\n")
    stops = StopStrings(tok, ["\n\n"])
    stops.rows([prompt])
    assert [n for n in range(1, len(tokens) + 1) if stops(0, tokens[:n])] == [len(tokens)]

