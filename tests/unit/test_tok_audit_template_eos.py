"""A chat template that closes each answer with eos_token (Llama-2's, Mistral's: `... answer</s>`), the EOS the
store separates documents with: `data build --messages-field` stored that answer's </s> and then its own EOS, a
second </s>, trained on (the model learnt EOS after EOS), and a conversation cut after such an answer
(--long-conversations truncate) ended with two as well. The rendering's own </s> is the document's one EOS."""

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from test_data_build import opts, quiet, store_documents  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.loader import PackedSamples  # noqa: E402
from longctx.data.tokenizer import load_tokenizer  # noqa: E402

# Mistral-Instruct's template (its [INST] turns, each answer closed by eos_token)
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
LONG = [m for i in range(4) for m in ({"role": "user", "content": f"Question {i}?"},
                                      {"role": "assistant", "content": f"Answer {i} " + "and more " * 6})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("mistral")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["[INST] What is 2 + 2? [/INST] Question Answer and more\n"] * 50, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>", "chat_template": MISTRAL_TEMPLATE}))
    return d


def _build(tmp_path, folder, conversations, seq_len=256):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    build_store(opts([path], tmp_path / "store", dedup="none", strategy="bfd", eval_fraction=0.0,
                     tokenizer=str(folder / "tokenizer.json"), messages_field="messages", seq_len=seq_len), log=quiet)
    return tmp_path / "store"


def _rendered_ids(folder, messages):
    from longctx.data.chat_template import load_chat_template

    tok = load_tokenizer(str(folder / "tokenizer.json"))
    text = load_chat_template(str(folder / "tokenizer.json")).render(messages, add_generation_prompt=False)
    return [int(t) for t in tok.encode_encodings([text], special_tokens=True)[0].ids], tok.eos_id


def test_a_template_that_ends_answers_with_the_eos_stores_one_eos(tmp_path, folder):
    whole, eos = _rendered_ids(folder, CHAT)
    assert whole[-1] == eos and whole[-2] != eos  # (the rendering ends with the template's </s>)
    root = _build(tmp_path, folder, [CHAT])
    doc = store_documents(root)[0]
    assert doc == whole, f"stored {doc[-4:]}, rendered {whole[-4:]}: the template's EOS followed by another"
    found = {j for _, j in _targets(PackedSamples(root, "train"))[0]}
    trained = [doc[j] for j in sorted(found)]
    assert trained.count(eos) == 2  # (each answer's own </s>, once)
    assert not any(a == b == eos for a, b in zip(doc, doc[1:]))


def test_a_conversation_cut_after_an_answer_that_ends_with_the_eos_ends_with_one(tmp_path, folder):
    kept = LONG[:4]
    seq_len = len(_rendered_ids(folder, kept)[0]) + 2
    assert len(_rendered_ids(folder, LONG)[0]) > seq_len
    cut, alone = _build(tmp_path / "cut", folder, [LONG], seq_len), _build(tmp_path / "alone", folder, [kept], seq_len)
    whole, eos = _rendered_ids(folder, kept)
    assert store_documents(cut)[0] == store_documents(alone)[0] == whole
    assert _targets(PackedSamples(cut, "train")) == _targets(PackedSamples(alone, "train"))
    assert np.count_nonzero(np.asarray(store_documents(cut)[0]) == eos) == 2
