"""--echo with a stop string: the echoed continuation is cut where the line's own text is, so an echoed
line reads the prompt then the text, whatever the tokenizer's decoder does to a decoding's first space.

A SentencePiece decoder (Llama-2's, Mistral's tokenizer.json: Metaspace with a Strip of the first space)
decodes a continuation alone without its first space ('▁Answer' alone is 'Answer'), which is the text the
stop strings are checked on and the line's "text"; --echo decodes it after the prompt's last ids, first
space kept (output.py continuation_text). A stop string that begins with that space, " Answer", is not in
the text at its start, so the row ran on to its next " Answer"; the echo was cut at the first one, which
the text does not hold: "Question: what?" where the text read "Answer: yes" (the answer lost)."""

import io
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

from longctx.data.tokenizer import HFTokenizer  # noqa: E402
from longctx.generate.output import Output, StopStrings  # noqa: E402
from longctx.generate.results import Result  # noqa: E402


def _sentencepiece_like(path):
    """A tiny tokenizer.json with Llama-2's normaliser and decoder: '▁' for spaces, one prepended, and the
    decoder's Strip of the first space (the vocabulary: the pieces below and every byte, as fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = ["▁", "Question:", "▁what?", "Answer:", "▁yes", "▁no", "▁Answer:"]
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({p: 256 + i for i, p in enumerate(pieces)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])  # (the end of a document longctx's reader asks for)
    tok.save(str(path))
    return HFTokenizer(path), {p: 256 + i for i, p in enumerate(pieces)}


def _line(tok, prompt, tokens, stops, echo) -> str:
    output = Output(tok, stops, "", 1, len(tokens), main_rank=True, echo=echo)
    output.file = io.StringIO()
    output.write(prompt, Result(len(prompt["ids"]), tokens, "stop", 1.0, 1.0), speculative=False)
    return json.loads(output.file.getvalue())["text"]


def test_the_echo_is_cut_where_the_text_is(tmp_path):
    tok, ids = _sentencepiece_like(tmp_path / "tokenizer.json")
    prompt = {"text": "Question: what?", "ids": [ids["▁"], ids["Question:"], ids["▁what?"]]}
    assert tok.decode(prompt["ids"]) == prompt["text"]
    # the continuation " Answer: yes Answer: no", as a model writes it: its first token '▁' then 'Answer:'
    tokens = [ids["▁"], ids["Answer:"], ids["▁yes"], ids["▁Answer:"], ids["▁no"]]
    assert tok.decode(tokens) == "Answer: yes Answer: no"  # (alone: the first space stripped)
    stops = [" Answer"]
    checker = StopStrings(tok, stops)
    end = next(n for n in range(1, len(tokens) + 1) if checker(0, tokens[:n]))
    assert end == 4  # the text's first " Answer" (its start's has no space in the text)
    text = _line(tok, prompt, tokens[:end], stops, echo=False)
    assert text == "Answer: yes"
    echoed = _line(tok, prompt, tokens[:end], stops, echo=True)
    assert echoed == prompt["text"] + " " + text  # the prompt, its space, then the line's text
