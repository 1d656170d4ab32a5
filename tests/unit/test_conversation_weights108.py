"""OpenAI's fine-tuning format marks an assistant message `"weight": 0` to be read, not trained on (their
multi-turn fine-tuning docs: weight 0 or 1, on assistant messages). The build ignored the key and trained every
answer, the ones the data says not to learn included. Now a weight-0 answer is history; the turns after the last
answer trained on are dropped (nothing learns from them); a weight other than 0 or 1 is a counted bad
conversation."""

import pytest

transformers = pytest.importorskip("transformers")
from test_conversations import _build  # noqa: E402
from test_data_build import store_documents  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.loader import PackedSamples  # noqa: E402

TURNS = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
         {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"},
         {"role": "user", "content": "third question"}, {"role": "assistant", "content": "third answer"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    _chat_tokenizer(d)
    return d


def _ids(folder, messages, **kw):
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    return list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def _trained(tmp_path, folder, messages, answers="all"):
    """The stored document's ids and the positions in it whose token is trained."""
    _build(tmp_path, folder, [{"messages": messages}], answers=answers)
    doc = store_documents(tmp_path / "store")[0]
    return doc, sorted(j for _, j in _targets(PackedSamples(tmp_path / "store", "train"))[0])


def _answer_span(folder, messages, i):
    return range(len(_ids(folder, messages[:i], add_generation_prompt=True)), len(_ids(folder, messages[:i + 1])))


def test_a_weight_0_answer_is_read_not_trained(tmp_path, folder):
    messages = [dict(m) for m in TURNS]
    messages[3]["weight"] = 0
    doc, trained = _trained(tmp_path, folder, messages)
    assert doc[:-1] == _ids(folder, messages)  # (the whole conversation is stored)
    assert not set(_answer_span(folder, messages, 3)) & set(trained)
    assert set(_answer_span(folder, messages, 1)) <= set(trained)
    plain_doc, plain = _trained(tmp_path / "plain", folder, TURNS)
    assert set(_answer_span(folder, TURNS, 3)) <= set(plain) and len(plain) > len(trained)


def test_turns_after_the_last_trained_answer_are_dropped(tmp_path, folder):
    messages = [dict(m) for m in TURNS]
    messages[5]["weight"] = 0
    doc, trained = _trained(tmp_path, folder, messages)
    assert doc[:-1] == _ids(folder, messages[:4])  # (stored through the second answer)
    first, second = set(_answer_span(folder, messages, 1)), set(_answer_span(folder, messages, 3))
    assert first <= set(trained) and second <= set(trained)
    _, last = _trained(tmp_path / "last", folder, messages, answers="last")  # (--answers last: the last weighted)
    assert first.isdisjoint(last) and second <= set(last)


@pytest.mark.parametrize("weight, role", [(0.5, "assistant"), (2, "assistant"), ("1", "assistant"), (True, "assistant"),
                                          (1, "user")])
def test_a_weight_other_than_0_or_1_or_on_another_message_is_a_bad_conversation(tmp_path, folder, weight, role):
    messages = [dict(m) for m in TURNS]
    messages[3 if role == "assistant" else 2]["weight"] = weight
    records = [{"messages": messages}, {"messages": TURNS}]
    counts = _build(tmp_path, folder, records)["parts"][0]["counts"]
    assert counts["skipped"] == {"bad_conversation": 1} and counts["documents_kept"] == 1


def test_every_answer_weight_0_is_an_empty_skip(tmp_path, folder):
    messages = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in TURNS]
    counts = _build(tmp_path, folder, [{"messages": messages}, {"messages": TURNS}])["parts"][0]["counts"]
    assert counts["skipped"] == {"empty": 1} and counts["documents_kept"] == 1
    assert len(store_documents(tmp_path / "store")) == 1
