"""`data build --messages-field` with Phi-3's chat template (Phi-3-mini / Phi-3.5-mini-instruct), which writes
eos_token after the last message when no answer is asked for: every answer of a conversation is trained on (it
was its last one only, the earlier ones counted as rendered otherwise in the history), each from the end of
apply_chat_template(what it answers, add_generation_prompt=True) to its <|end|> and line break, as the whole
conversation holds it (no EOS after an earlier answer); the last one with the document's one EOS."""

import json

import pytest

transformers = pytest.importorskip("transformers")
from test_conversations import _build  # noqa: E402
from test_data_build import store_documents  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.loader import PackedSamples  # noqa: E402

PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif "
        "message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    _chat_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.update(chat_template=PHI3, eos_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_every_answer_is_trained_with_a_template_that_closes_the_conversation_with_the_eos(tmp_path, folder):
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = lambda messages, **kw: list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))  # noqa: E731
    manifest = _build(tmp_path, folder, [{"messages": MESSAGES}])
    assert "last_answer_only" not in manifest["parts"][0]["counts"]
    (doc,) = store_documents(tmp_path / "store").values()
    whole = ids(MESSAGES)
    assert doc == whole and whole[-1] == theirs.convert_tokens_to_ids("<|endoftext|>")  # (one EOS: the template's)
    expected = set()
    for i, end in ((1, len(ids(MESSAGES[:2])) - 1), (3, len(whole))):  # (the first without its closing EOS)
        expected |= set(range(len(ids(MESSAGES[:i], add_generation_prompt=True)), end))
    found, _ = _targets(PackedSamples(tmp_path / "store", "train"))
    assert {j for _, j in found} == expected
    assert theirs.decode([doc[j] for j in sorted(expected)]) == "Hello.<|end|>\n4<|end|>\n<|endoftext|>"


@pytest.mark.parametrize("dedup", ["exact", "minhash"])
def test_a_conversation_cut_after_an_earlier_answer_is_the_shorter_conversation_and_its_duplicate(tmp_path, folder,
                                                                                                 dedup):
    """--long-conversations truncate: cut after its first answer, the conversation is stored and trained as the
    shorter conversation (whose rendering ends with the template's closing EOS), and is an exact copy of it
    (it was compared without that closing: both kept under exact dedup, one found only as a near copy)."""
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    seq_len = len(theirs.apply_chat_template(MESSAGES[:2], tokenize=True, return_dict=False)) + 2
    longer = [*MESSAGES[:3], {"role": "assistant", "content": "four " * seq_len}]
    cut = _build(tmp_path / "cut", folder, [{"messages": longer}], seq_len=seq_len)
    _build(tmp_path / "alone", folder, [{"messages": MESSAGES[:2]}], seq_len=seq_len)
    assert cut["parts"][0]["stages"]["tokenize"]["conversations_truncated"] == 1
    a, b = tmp_path / "cut" / "store", tmp_path / "alone" / "store"
    assert store_documents(a) == store_documents(b)
    assert _targets(PackedSamples(a, "train")) == _targets(PackedSamples(b, "train"))
    both = _build(tmp_path / dedup, folder, [{"messages": m} for m in (longer, MESSAGES[:2])], seq_len=seq_len,
                  dedup=dedup)
    assert len(store_documents(tmp_path / dedup / "store")) == 1
    assert both["parts"][0]["counts"]["exact_duplicates"] == 1


def test_an_append_to_a_store_cut_by_older_answer_rules_says_its_copies_may_not_be_found(tmp_path, folder):
    """A part built before the answer rules changed (conversations.RULES: Phi-3's earlier answers trained, tool
    calls, cut conversations hashed as the shorter one) hashed its conversations otherwise: an append's exact
    copies of them are not found. Said, as an older dedup version is (it was silent); a part of these rules is
    recorded with them and says nothing."""
    from longctx.data.builder.conversations import RULES

    _build(tmp_path, folder, [{"messages": MESSAGES}], dedup="exact")
    path = tmp_path / "store" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["parts"][0]["answer_rules"] == RULES
    said = []
    log = lambda *a, **k: said.append(" ".join(map(str, a)))  # noqa: E731
    _build(tmp_path, folder, [{"messages": MESSAGES[:2] + MESSAGES[:2]}], dedup="exact", append=True, log=log)
    assert not any("older rules" in s for s in said), said  # (a part of these rules)
    manifest = json.loads(path.read_text())
    del manifest["parts"][0]["answer_rules"]  # (as an older longctx wrote it)
    path.write_text(json.dumps(manifest))
    _build(tmp_path, folder, [{"messages": MESSAGES[2:] + MESSAGES[2:]}], dedup="exact", append=True, log=log)
    assert any("older rules" in s and "rebuild the store" in s for s in said), said
