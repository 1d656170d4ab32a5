"""Conversations as instruction data (`data build --messages-field`, data/builder/conversations.py): a
record's conversation rendered by the tokenizer's chat template (SmolLM2-Instruct's, as in
test_generate_chat) is stored as transformers' apply_chat_template tokenizes it, trained on its answers
(--answers all) or its last one (--answers last): an answer's prompt is apply_chat_template(the
conversation before it, add_generation_prompt=True).
Records that are no conversation, or that the template cannot split there, are counted skips."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from test_data_build import opts, quiet, store_documents  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.loader import PackedSamples  # noqa: E402
from longctx.data.store import LOSS_FROM  # noqa: E402
from longctx.errors import DataError  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "You answer in Python."}, {"role": "user", "content": "def f(x):"},
     {"role": "assistant", "content": "return x + 1"}, {"role": "user", "content": "And a class?"},
     {"role": "assistant", "content": "class A:\n    pass"}],
]
NOT_CONVERSATIONS = [
    [{"role": "user", "content": "no answer yet"}],  # (ends with the user)
    "a string",
    [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    _chat_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def merging(tmp_path_factory, folder):
    """The chat tokenizer with "\n\n" one token (its first merge): an answer that starts with a line break
    after the generation prompt's would share a token with it, read whole."""
    from test_generate_chat import SPECIALS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("merging")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a\n\nb\n\nc\n\n" * 20, "user assistant system what\n\n"] * 50, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_bytes((folder / "tokenizer_config.json").read_bytes())
    assert len(Tokenizer.from_file(str(d / "tokenizer.json")).encode("\n\n").ids) == 1
    return d


def _build(tmp_path, folder, records, log=quiet, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kw = {"dedup": "none", "strategy": "bfd", "eval_fraction": 0.0, "tokenizer": str(folder / "tokenizer.json"),
          "messages_field": "messages", "seq_len": 256, **kw}
    return build_store(opts([path], tmp_path / "store", **kw), log=log)


@pytest.mark.parametrize("answers", ["all", "last"])
def test_the_answers_are_trained_after_the_conversation_as_transformers_renders_it(tmp_path, folder, answers):
    """Stored as apply_chat_template's ids of the whole conversation; each answer trained from the end of
    apply_chat_template(what it answers, add_generation_prompt=True) to the end of the rendering through
    it (its <|im_end|> and "\n"; the last one's EOS too). --answers last: the first answer of the second
    conversation is prompt."""
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    records = [{"messages": m} for m in CONVERSATIONS] + [{"messages": m} for m in NOT_CONVERSATIONS] + [{"x": 1}]
    said = []
    manifest = _build(tmp_path, folder, records, answers=answers, log=said.append)
    several = ", 1 of them on several answers" if answers == "all" else ""
    assert any(f"2 documents (2 trained on their responses only{several})" in line for line in said)
    assert manifest["parts"][0]["counts"]["skipped"] == {"bad_conversation": 4}
    assert manifest["version"] == (4 if answers == "all" else 3)  # (a store of gaps: refused by a reader before)
    root = tmp_path / "store"
    docs, firsts = store_documents(root), np.load(root / "part-00000" / LOSS_FROM)
    expected = set()
    eos = theirs.convert_tokens_to_ids("<|endoftext|>")
    ids = lambda messages, **kw: list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))  # noqa: E731
    for doc, messages in enumerate(CONVERSATIONS):
        whole = ids(messages)
        assert docs[doc] == [*whole, eos]
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"][-1 if answers == "last" else 0:]
        for i in trained:
            start, end = len(ids(messages[:i], add_generation_prompt=True)), len(ids(messages[:i + 1]))
            assert whole[:start] == ids(messages[:i], add_generation_prompt=True)
            expected |= {(doc, j) for j in range(start, end if i < len(messages) - 1 else len(whole) + 1)}
        assert firsts[doc] == len(ids(messages[:trained[0]], add_generation_prompt=True))
    assert len(expected) > 0 and _targets(PackedSamples(root, "train"))[0] == expected


def test_a_template_whose_generation_prompt_is_not_how_an_answer_begins_is_a_counted_skip(tmp_path, folder):
    """A generation prompt the history does not repeat (a reasoning model's empty thinking block after
    `assistant`, say): the whole conversation's rendering does not begin with the prompt's, so the answer
    cannot be told apart from it."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("{{ '<|im_start|>assistant\n' }}",
                                                              "{{ '<|im_start|>assistant\n<think></think>\n' }}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="no usable document .*2 template not prefix-stable"):
        _build(tmp_path, other, [{"messages": m} for m in CONVERSATIONS])
    manifest = _build(tmp_path, folder, [{"messages": m} for m in CONVERSATIONS])  # (the template as it was)
    assert manifest["parts"][0]["counts"]["documents_kept"] == 2


@pytest.mark.parametrize("kw,message", [
    ({"tokenizer": "byte"}, "--messages-field applies the tokenizer's chat template, and the byte tokenizer has none"),
    ({"response_field": "response"}, "--response-field and --messages-field do not go together"),
    ({"strategy": "concat"}, "--strategy concat cuts documents"),
    ({"messages_field": "", "text_field": "messages", "answers": "last"}, "--answers last .* needs --messages-field"),
    ({"answers": "first"}, "--answers 'first' is not one of all, last"),
])
def test_conversations_without_a_template_or_with_pair_options_are_refused_before_work(tmp_path, folder, kw, message):
    with pytest.raises(DataError, match=message):
        _build(tmp_path, folder, [{"messages": CONVERSATIONS[0]}], **kw)
    assert not (tmp_path / "store").exists()


def test_an_answer_whose_first_token_would_straddle_its_prompt_is_each_piece_as_the_model_writes_it(tmp_path,
                                                                                                   merging):
    """An earlier answer beginning with "\n" after the generation prompt's "\n": the whole text's ids
    merge the two (no boundary at the answer), so the pieces are encoded apart; each trained span is
    then exactly its answer and end of turn, the turn between is not trained on."""
    folder = merging
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nfirst line"},
                {"role": "user", "content": "More?"}, {"role": "assistant", "content": "second"}]
    _build(tmp_path, folder, [{"messages": messages}])
    root = tmp_path / "store"
    (doc,) = store_documents(root).values()
    found, _ = _targets(PackedSamples(root, "train"))
    trained = sorted(j for _, j in found)
    runs = np.split(np.array(trained), np.flatnonzero(np.diff(trained) > 1) + 1)
    assert [theirs.decode(doc[r[0]:r[-1] + 1]) for r in runs] == [
        "\n\nfirst line<|im_end|>\n", "second<|im_end|>\n<|endoftext|>"]
    assert doc[:runs[0][0]] == list(theirs.apply_chat_template(messages[:1], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False))
    # (read whole, the text's ids differ: the pieces were encoded apart, the case this is about)
    assert doc[:-1] != list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False))


def _with_template(tmp_path, folder, name, template):
    other = tmp_path / name
    other.mkdir()
    (other / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return other


def test_bad_conversations_and_a_failing_template_are_counted_skips_not_a_crash(tmp_path, folder):
    """An empty answer, a lone answer (no prompt before it), and a template expression that fails on a
    record (a division by zero of its own): counted, the build goes on with the rest."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% if m['content'] == 'boom' %}{{ 1 // 0 }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    other = _with_template(tmp_path, folder, "failing", template)
    records = [CONVERSATIONS[0], [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}],
               [{"role": "assistant", "content": "alone"}],
               [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]]
    manifest = _build(tmp_path, other, [{"messages": m} for m in records])
    counts = manifest["parts"][0]["counts"]
    assert counts["skipped"] == {"empty": 1, "bad_conversation": 2} and counts["documents_kept"] == 1


def test_a_template_that_does_not_compile_is_refused_before_work(tmp_path, folder):
    other = _with_template(tmp_path, folder, "broken", "{% for m in messages %}{{ m['content'] | nosuchfilter }}")
    with pytest.raises(DataError, match="--messages-field: the chat template of .* is not a Jinja template"):
        _build(tmp_path, other, [{"messages": CONVERSATIONS[0]}])
    assert not (tmp_path / "store").exists()


def test_a_revised_template_is_another_scan(tmp_path, folder):
    """A template edited beside an unchanged tokenizer.json renders other documents: a resumed or merged
    build must not take the scans of one for the other."""
    from longctx.data.builder.scan import ScanOptions, plan_digest

    config = json.loads((folder / "tokenizer_config.json").read_text())
    d = _with_template(tmp_path, folder, "edited", config["chat_template"])

    def digest(template):
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        return plan_digest([], ScanOptions(str(d / "tokenizer.json"), "none", "text", "", "messages"))
    first = digest(config["chat_template"])
    assert digest(config["chat_template"].replace("helpful", "careful")) != first == digest(config["chat_template"])


def test_each_switch_is_found_as_encoding_the_whole_prefix_would_find_it(merging):
    """tokenize.py _switch_at encodes the text up to a switch only from the last added token before it
    (linear in a long conversation); it must give what encoding the whole prefix gives: the length of its
    ids where they begin the whole text's, else None (a straddling token). Random conversations, some
    answers starting with the line break that merges with the generation prompt's."""
    import random
    from collections import Counter
    from itertools import accumulate

    from longctx.data.builder.conversations import Conversations
    from longctx.data.builder.tokenize import _added_tokens, _piece, _switch_at
    from longctx.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(merging / "tokenizer.json"))
    conversations = Conversations(str(merging / "tokenizer.json"), "messages")
    rng, found = random.Random(0), Counter()
    words = ["def", "class", "x", "+", "1", "\n", "\n\n", " ", "assistant", "<|im_end|>", "what"]
    for _ in range(40):
        messages = []
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                messages.append({"role": role, "content": "".join(rng.choice(words) for _ in range(8))})
        pieces = conversations.pieces(messages, Counter())
        if pieces is None:
            continue
        text = "".join(pieces)
        w_ids = _piece(text, tok, after_text=False)[0]
        anchors = _added_tokens(text, tok, w_ids)
        for c in accumulate(len(p) for p in pieces[:-1]):
            ids = _piece(text[:c], tok, after_text=False)[0]
            whole = len(ids) if np.array_equal(w_ids[:len(ids)], ids) else None
            assert _switch_at(text, c, tok, w_ids, anchors) == whole
            found[whole is None] += 1
    assert found[False] > 20 and found[True] > 0  # (both cases met)


def test_a_sharegpt_conversation_is_read_as_role_and_content(tmp_path, folder):
    """ShareGPT's messages (`from`: human / gpt / system, `value`) give the same store as role / content ones."""
    def sharegpt(messages):
        speaker = {"user": "human", "assistant": "gpt", "system": "system"}
        return [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]

    for name, records in (("a", CONVERSATIONS), ("b", [sharegpt(m) for m in CONVERSATIONS])):
        (tmp_path / name).mkdir()
        _build(tmp_path / name, folder, [{"messages": m} for m in records])
    assert store_documents(tmp_path / "a" / "store") == store_documents(tmp_path / "b" / "store")
    a, b = (np.load(tmp_path / d / "store" / "part-00000" / LOSS_FROM) for d in ("a", "b"))
    assert np.array_equal(a, b) and len(a) == len(CONVERSATIONS)


def test_an_added_token_matched_after_normalisation_is_no_anchor(tmp_path):
    """An added token with normalized=True (`add_tokens`' default) is matched in the normalised text, where a
    Prepend('▁') normalizer's space before it joins it: the text is not read apart there, so encoding from it
    would find a straddle that encoding the whole prefix does not (a review's finding). Only normalized=False
    added tokens anchor the local check, and a local miss is confirmed on the whole prefix."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers

    from longctx.data.builder.tokenize import _added_tokens, _piece, _switch_at
    from longctx.data.tokenizer import load_tokenizer

    vocab = {c: i for i, c in enumerate(["<unk>", "▁", "a", "b", "x", "\n"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken("</s>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<|im_end|>", normalized=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    for text, c in (("a <|im_end|>\nb\nx", len("a <|im_end|>\nb")),
                    ("a </s>\nb <|im_end|>\nx", len("a </s>\nb <|im_end|>"))):
        w = _piece(text, t, after_text=False)[0]
        ids = _piece(text[:c], t, after_text=False)[0]
        whole = len(ids) if np.array_equal(w[:len(ids)], ids) else None
        assert _switch_at(text, c, t, w, _added_tokens(text, t, w)) == whole


def test_a_template_that_renders_history_otherwise_trains_the_last_answer_and_says_so(tmp_path, folder):
    """Qwen3's template writes an empty thinking block in the last assistant turn only (and after the
    generation prompt): an earlier answer reads otherwise once it is history, so it cannot be cut out of the
    whole rendering. The conversation is kept, trained on its last answer only, and counted (not skipped)."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
                "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}")
    other = _with_template(tmp_path, folder, "qwen3", template)
    said = []
    manifest = _build(tmp_path, other, [{"messages": m} for m in CONVERSATIONS], log=said.append)
    counts = manifest["parts"][0]["counts"]
    assert counts["documents_kept"] == 2 and counts["skipped"] == {} and counts["last_answer_only"] == 1
    assert manifest["version"] == 3 and "answer_gap_documents" not in counts  # (one span each)
    assert any("1 conversations trained on their last answer only" in line for line in said)
    root = tmp_path / "store"
    theirs = transformers.AutoTokenizer.from_pretrained(str(other))
    docs = store_documents(root)
    expected = set()
    for doc, messages in enumerate(CONVERSATIONS):
        start = len(theirs.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
        expected |= {(doc, j) for j in range(start, len(docs[doc]))}
    assert _targets(PackedSamples(root, "train"))[0] == expected


LONG = [{"role": "system", "content": "You explain code."},
        *[m for i in range(3) for m in ({"role": "user", "content": f"Question {i}: what does line {i} do?"},
                                        {"role": "assistant", "content": f"Line {i} " + "adds one to x and " * 12})]]


@pytest.mark.parametrize("room", [0, -1])
def test_a_conversation_longer_than_a_sample_is_cut_after_its_last_answer_that_fits(tmp_path, folder, room):
    """--long-conversations truncate (the default): a conversation longer than --seq-len is stored as the
    conversation through its last answer that fits with its EOS (room 0: the second answer's EOS the
    sample's last token; room -1: one token short, so the first), tokens and trained labels equal to a build
    of that shorter conversation; one whose first answer does not fit, and with --answers last one that has
    no earlier answer to cut after, is dropped and counted; --long-conversations drop drops them all."""
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = lambda messages: theirs.apply_chat_template(messages, tokenize=True, return_dict=False)  # noqa: E731
    seq_len = len(ids(LONG[:5])) + 1 + room
    assert len(ids(LONG)) + 1 > seq_len > len(ids(LONG[:3])) + 1
    huge = [{"role": "user", "content": "Say it all."}, {"role": "assistant", "content": "x = 1\n" * seq_len}]
    records = [{"messages": m} for m in (LONG, CONVERSATIONS[0], huge)]
    said = []
    cut = _build(tmp_path / "cut", folder, records, seq_len=seq_len, log=said.append)
    assert cut["parts"][0]["counts"]["skipped"] == {"pair_longer_than_sample": 1}
    assert cut["parts"][0]["stages"]["tokenize"]["conversations_truncated"] == 1
    assert any("cut 1 conversation(s) longer than a sample" in line for line in said)
    kept = LONG[:5] if room == 0 else LONG[:3]
    alone = _build(tmp_path / "alone", folder, [{"messages": m} for m in (kept, CONVERSATIONS[0])], seq_len=seq_len)
    assert "conversations_truncated" not in alone["parts"][0]["stages"]["tokenize"]
    a, b = tmp_path / "cut" / "store", tmp_path / "alone" / "store"
    assert store_documents(a) == store_documents(b) and len(store_documents(a)[0]) == len(ids(kept)) + 1
    assert _targets(PackedSamples(a, "train")) == _targets(PackedSamples(b, "train"))
    for kw in ({"long_conversations": "drop"}, {"answers": "last"}):
        said.clear()
        dropped = _build(tmp_path / next(iter(kw)), folder, records, seq_len=seq_len, log=said.append, **kw)
        assert dropped["parts"][0]["counts"]["skipped"] == {"pair_longer_than_sample": 2}
        assert any("dropped 2 conversation(s) longer than a sample" in line for line in said)  # (not "pair(s)")
    with pytest.raises(DataError, match=f"every document is a conversation longer than --seq-len {seq_len}"):
        _build(tmp_path / "none", folder, [{"messages": huge}], seq_len=seq_len)


@pytest.mark.parametrize("dedup", ["exact", "minhash"])
def test_a_cut_conversation_is_deduplicated_as_it_is_stored(tmp_path, folder, dedup):
    """Dedup compared a cut conversation whole (before its cut): two conversations that share their first answers
    but not the last, and the shorter conversation itself, were stored three times as the same document."""
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    seq_len = len(theirs.apply_chat_template(LONG[:5], tokenize=True, return_dict=False)) + 1
    other = LONG[:5] + [{"role": "user", "content": "Something else entirely?"},
                        {"role": "assistant", "content": "A different final answer " * 8}]
    built = _build(tmp_path, folder, [{"messages": m} for m in (LONG, other, LONG[:5])], seq_len=seq_len, dedup=dedup)
    assert len(store_documents(tmp_path / "store")) == 1
    assert built["parts"][0]["counts"]["exact_duplicates"] == 2
