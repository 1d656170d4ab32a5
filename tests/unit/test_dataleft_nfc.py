"""Per-piece NFC of instruction data (helper dataleft): a pair's prompt and response, and a conversation's rendered
pieces, are normalised apart, not as one text. Where a piece starts with a combining character that composes with
the piece before it (a prompt ending `e`, an answer starting U+0301), the whole's NFC differs (`é`): it would train
the model to write a character of its prompt, while at inference the prompt is read as given (a tokenizer's NFC
normalizer reads it alone) and the model writes U+0301 after it. The ids pinned here are the prompt's encoded alone,
then the answer's encoded alone: what the model reads and writes (docs/data.md, conversations)."""

import json
import unicodedata
from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from longctx.data.builder import readers
from longctx.data.builder.tokenize import tokenize_answers
from longctx.data.tokenizer import HFTokenizer

CHARS = ["[UNK]", "</s>", "S", "a", "y", " ", "c", "f", "e", "\u0301", "\u00e9", "i", "s", "o", "k", "\u1100",
         "\u1161", "\uac00", "\u0327", "\u00e7"]
PROMPT, ANSWER = "Say cafe", "\u0301 is ok"


@pytest.fixture
def folder(tmp_path):
    """A character-level tokenizer with an NFC normalizer (as Qwen2's and others' have), and a chat template that
    puts an answer right after the user's text (no separator: the case where a boundary can compose)."""
    t = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(CHARS)}, unk_token="[UNK]"))
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.add_special_tokens(["</s>"])
    t.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    return tmp_path


def _alone(tok, text):
    return tok._tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("prompt, answer", [(PROMPT, ANSWER), ("Say \u1100", "\u1161 ok"), ("fac", "\u0327a")])
def test_a_pair_trains_the_answer_as_written_after_its_prompt(folder, prompt, answer):
    tok = HFTokenizer(folder / "tokenizer.json")
    whole = unicodedata.normalize("NFC", prompt + answer)
    assert whole != prompt + answer  # (the reproducer: the whole's NFC composes across the boundary)
    doc = readers._accept(prompt, "x.jsonl:1", Counter(), answer)
    assert doc.text == prompt + answer and doc.trained_chars == (len(prompt),)
    tokens, _, _, switches = tokenize_answers(doc.text, doc.trained_chars, tok)
    want = _alone(tok, prompt) + _alone(tok, answer) + [tok.eos_id]
    assert tokens.tolist() == want and switches.tolist() == [len(_alone(tok, prompt))]
    # normalised whole, the ids differ: one token for the composed character, which no boundary parts
    assert _alone(tok, whole) != want[:-1] and len(_alone(tok, whole)) == len(want) - 2


def test_a_conversation_trains_the_answer_as_written_after_its_prompt(folder):
    from longctx.data.builder.conversations import Conversations

    conversations = Conversations(str(folder / "tokenizer.json"), "messages")
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ANSWER}]
    fields, accept = readers._record_reader("text", "", conversations)
    doc = accept([messages], "x.jsonl:1", Counter())
    assert doc is not None and doc.text == PROMPT + ANSWER and doc.trained_chars == (len(PROMPT),)
    tok = HFTokenizer(folder / "tokenizer.json")
    tokens, _, _, switches = tokenize_answers(doc.text, doc.trained_chars, tok, prefix=False)
    want = _alone(tok, PROMPT) + _alone(tok, ANSWER) + [tok.eos_id]
    assert tokens.tolist() == want and switches.tolist() == [len(_alone(tok, PROMPT))]
    assert np.array_equal(tokens[switches[0]:switches[0] + 1], [CHARS.index("\u0301")])  # (trained from U+0301)


def test_each_piece_is_still_nfc_inside(folder):
    """Within a piece, a decomposed accent is composed as ever (tests/unit/test_leftovers117.py: the whole
    conversation's NFC / LF text where no boundary composes)."""
    doc = readers._accept("Say cafe\u0301", "x.jsonl:1", Counter(), "o\u0301k")
    assert doc.text == "Say caf\u00e9" + "\u00f3k" and doc.trained_chars == (len("Say caf\u00e9"),)
