"""Stop strings and the line's text read the continuation as it reads after the prompt.

A SentencePiece decoder (Llama-2's, Mistral's tokenizer.json: Metaspace with a Strip of the first space)
decodes a continuation alone without its first space ('▁Answer' alone is 'Answer'). longctx checked the stop
strings on that text, so a stop string beginning with the space (" Answer") was missed at the continuation's
start and the row ran on to a later match, where transformers' StopStringCriteria (on prompt + continuation)
and vLLM (text detokenized after the prompt) stop; and --echo, decoded after the prompt, was cut at the first
match, which the line's text did not hold ('Question: what?' for the text 'Answer: yes'). Now the check, the
text (its first space kept, as transformers' pipeline and vLLM give it), the echo and the stream all read the
continuation after the prompt's last ids."""

import io
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

from longctx.data.tokenizer import HFTokenizer  # noqa: E402
from longctx.generate.output import Output, StopStrings, Stream  # noqa: E402
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


@pytest.fixture()
def case(tmp_path):
    tok, ids = _sentencepiece_like(tmp_path / "tokenizer.json")
    prompt = {"text": "Question: what?", "ids": [ids["▁"], ids["Question:"], ids["▁what?"]]}
    assert tok.decode(prompt["ids"]) == prompt["text"]
    # the continuation " Answer: yes Answer: no", as a model writes it: its first token '▁' then 'Answer:'
    tokens = [ids["▁"], ids["Answer:"], ids["▁yes"], ids["▁Answer:"], ids["▁no"]]
    assert tok.decode(tokens) == "Answer: yes Answer: no"  # (alone: the first space stripped)
    return tok, prompt, tokens, tmp_path / "tokenizer.json"


def _first_stop(checker, tokens) -> int:
    return next(n for n in range(1, len(tokens) + 1) if checker(0, tokens[:n]))


def _line(tok, prompt, tokens, stops, echo, reason="stop") -> str:
    output = Output(tok, stops, "", 1, len(tokens), main_rank=True, echo=echo)
    output.file = io.StringIO()
    output.write(prompt, Result(len(prompt["ids"]), tokens, reason, 1.0, 1.0), speculative=False)
    return json.loads(output.file.getvalue())["text"]


def test_a_stop_string_at_the_continuation_s_start_is_seen_as_transformers_sees_it(case):
    tok, prompt, tokens, path = case
    checker = StopStrings(tok, [" Answer"])
    checker.rows([prompt["ids"]])
    end = _first_stop(checker, tokens)
    # the reference: transformers' StopStringCriteria on prompt + continuation, token by token
    import torch
    from transformers import PreTrainedTokenizerFast, StopStringCriteria

    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    criteria = StopStringCriteria(hf, [" Answer"])
    ref = next(n for n in range(1, len(tokens) + 1)
               if bool(criteria(torch.tensor([prompt["ids"] + tokens[:n]]), None)[0]))
    assert end == ref == 2  # (read alone, the text's first " Answer" was the second one: token 4)
    assert _line(tok, prompt, tokens[:end], [" Answer"], echo=False) == ""
    assert _line(tok, prompt, tokens[:end], [" Answer"], echo=True) == prompt["text"]
    # without a prompt (a caller that sets no rows) the text is read alone, as before
    assert _first_stop(StopStrings(tok, [" Answer"]), tokens) == 4


def test_the_text_keeps_its_first_space_and_the_echo_reads_prompt_then_text(case):
    tok, prompt, tokens, _ = case
    text = _line(tok, prompt, tokens, [], echo=False, reason="length")
    assert text == " Answer: yes Answer: no"  # (transformers' pipeline: the whole decoded less the prompt's)
    assert _line(tok, prompt, tokens, [], echo=True, reason="length") == prompt["text"] + text
    cut = _line(tok, prompt, tokens[:4], [" no", "yes "], echo=False)
    assert cut == " Answer: "  # cut before the first stop string the text holds


def test_the_stream_shows_a_prefix_of_the_line_s_text(case, capsys):
    tok, prompt, tokens, _ = case
    for stops, n in (([], len(tokens)), ([" Answer"], 2), (["yes"], 3)):
        stream = Stream(tok, stops, prompt["ids"])
        for t in tokens[:n]:
            stream(0, t)
        shown = capsys.readouterr().err
        text = _line(tok, prompt, tokens[:n], stops, echo=False, reason="stop" if stops else "length")
        assert text.startswith(shown), (stops, shown, text)
        stream.finish(text)
        assert capsys.readouterr().err == text[len(shown):] + "\n"
