"""A randomized audit of conversations built into a store (`longctx data build --messages-field`) against a
reference written here from docs/data.md ("Conversations: `--messages-field`" and the pairs' rules it refers to),
computed with transformers' apply_chat_template and the tokenizer alone, none of the builder's code.

Seeded random corpora of conversations (an optional system prompt, one to six exchanges, tool turns, empty and
white-space answers, answers of weight 0, tool calls the template does not render (null content), ShareGPT's
form, Unicode (decomposed, CRLF), special tokens' strings in a message, answers that begin with line breaks (a
token that would straddle where training starts), turns longer than a sample, exact copies, records that are no
conversation) are
built with random options (seq_len, bfd / datasculpt, exact dedup or none, an eval fraction or a holdout grid,
--answers all / last, --long-conversations truncate / drop) by the chat template of test_generate_chat (SmolLM2's,
in tokenizer_config.json or chat_template.jinja). The reference per record:
- the document is the whole conversation's apply_chat_template ids and the EOS; where a token of the whole would
  straddle where an answer starts or stops, each piece between two such places encoded apart;
- trained: each answer (an assistant message after the first that holds text, weight not 0; --answers last: the
  last such one) from the end of apply_chat_template(messages[:i], add_generation_prompt=True) to the end of
  apply_chat_template(messages[:i + 1]), the last one on to the EOS; the turns after the last answer dropped;
- a document longer than a sample: stored as the conversation up to its last answer that leaves room for the EOS
  (--long-conversations truncate, --answers all), else dropped; exact dedup keeps one of each stored document.
The store is read through PackedSamples (train and eval, with and without document masks): every document is one
segment of one sample, the labels are exactly the reference's trained tokens (once each, across the store), and
the document masks restart positions and keep each conversation's own document id.
"""

import json
import random
from collections import Counter
from unicodedata import normalize

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from test_data_build import opts  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402

from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.loader import PackedSamples  # noqa: E402
from longctx.data.samples import IGNORE  # noqa: E402
from longctx.data.store import read_manifest  # noqa: E402
from longctx.errors import DataError  # noqa: E402

SEEDS = range(30)
WORDS = ("the", "what", "class", "def", "return", "x", "+", "1", "2", "pass", "assistant", "user", "héllo", "日本語",
         "e\u0301", "a\r\nb", "Ω", "🙂", "naïve", "\t", "é", "\n", "\n\n", "  ", "?", "42")
SPECIAL_WORDS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")  # (read as the special tokens: docs/data.md)
CALL = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"config" | "jinja": a folder with the chat tokenizer} and transformers' tokenizer of it."""
    out = {}
    for kind in ("config", "jinja"):
        d = tmp_path_factory.mktemp(kind)
        _chat_tokenizer(d, jinja_file=kind == "jinja")
        out[kind] = d
    return out, transformers.AutoTokenizer.from_pretrained(str(out["config"]))


# -- random conversations -----------------------------------------------------------------------------------

def text(rng, seq_len, long=0.05, empty=0.05):
    if rng.random() < empty:
        return rng.choice(["", " ", "\n"])
    n = rng.randint(seq_len, 3 * seq_len) if rng.random() < long else rng.randint(1, 12)
    out = " ".join(rng.choice(SPECIAL_WORDS if rng.random() < 0.01 else WORDS) for _ in range(n))
    return out if out.strip() else "ok"


def answer(rng, seq_len):
    content = text(rng, seq_len, empty=0.1)
    if rng.random() < 0.1:
        content = "\n\n" + content  # (a token across where the answer starts)
    m = {"role": "assistant", "content": content}
    if rng.random() < 0.1:
        m["weight"] = rng.choice([0, 1])
    if rng.random() < 0.05:  # (a call the template does not render: no answer, its null content no text)
        m.update(tool_calls=CALL, content=rng.choice([None, "", content]))
    return m


def conversation(rng, seq_len):
    msgs = [{"role": "system", "content": text(rng, seq_len)}] if rng.random() < 0.4 else []
    for _ in range(rng.choice([1, 1, 2, 3, 4, 6])):
        msgs.append({"role": "user", "content": text(rng, seq_len)})
        msgs.append(answer(rng, seq_len))
        if rng.random() < 0.15:
            msgs += [{"role": "tool", "content": text(rng, seq_len)}, answer(rng, seq_len)]
    if rng.random() < 0.1:
        msgs.append({"role": "user", "content": "no answer"})  # (no conversation: not the assistant's last)
    return msgs


def corpus(rng, seq_len):
    convs = [conversation(rng, seq_len) for _ in range(rng.randint(6, 16))]
    convs += [json.loads(json.dumps(rng.choice(convs))) for _ in range(rng.randint(0, 3))]  # exact copies
    rng.shuffle(convs)
    sharegpt = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
    return [[{"from": sharegpt[m["role"]], "value": m["content"]} for m in c]
            if rng.random() < 0.1 and all(set(m) == {"role", "content"} for m in c) else c for c in convs]


# -- the reference ------------------------------------------------------------------------------------------

class Reference:
    """A record's stored document as docs/data.md describes it, from transformers' apply_chat_template."""

    def __init__(self, tok, answers, seq_len, long):
        self.tok, self.answers, self.seq_len, self.long = tok, answers, seq_len, long
        self.eos = tok.convert_tokens_to_ids("<|endoftext|>")
        self.straddled = 0
        self.truncated = []  # (the documents stored cut, in record order)

    def ids(self, messages, gen=False):
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                 return_dict=False))

    def render(self, messages, gen=False):
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def document(self, messages):
        """(tokens, trained positions) stored for the record, or None (skipped)."""
        roles = {"human": "user", "gpt": "assistant"}  # (ShareGPT's; "system" and "tool" as they are)
        messages = [{"role": roles.get(m["from"], m["from"]), "content": m["value"]} if "from" in m else m
                    for m in messages]
        if not (isinstance(messages, list) and len(messages) > 1 and messages[-1]["role"] == "assistant"):
            return None
        messages = [{"role": m["role"], "content": m["content"] or ""} | ({"w": m["weight"]} if "weight" in m else {})
                    for m in messages]
        weighted = [i for i, m in enumerate(messages) if i and m["role"] == "assistant" and m.get("w", 1)]
        if not weighted or not messages[weighted[-1]]["content"].strip():
            return None
        # (text normalised as every document's is: LF line ends, Unicode NFC; docs/data.md, pairs)
        messages = [{"role": m["role"], "content": normalize("NFC", m["content"].replace("\r\n", "\n"))}
                    for m in messages[:weighted[-1] + 1]]
        trained = [i for i in weighted if messages[i]["content"].strip()]
        trained = trained[-1:] if self.answers == "last" else trained
        doc = self.whole(messages, trained)
        if len(doc[0]) <= self.seq_len:
            return doc
        if self.long == "truncate":
            for i in reversed(trained[:-1]):  # (the conversation up to its last answer that fits)
                short = self.whole(messages[:i + 1], [j for j in trained if j <= i])
                if len(short[0]) <= self.seq_len:
                    self.truncated.append(short)
                    return short
        return None

    def whole(self, messages, trained):
        whole, bounds = self.ids(messages), []
        for i in trained:
            bounds.append((self.ids(messages[:i], gen=True), self.render(messages[:i], gen=True)))
            if i < len(messages) - 1:
                bounds.append((self.ids(messages[:i + 1]), self.render(messages[:i + 1])))
        if all(whole[:len(b)] == b for b, _ in bounds):
            tokens, at = whole, [len(b) for b, _ in bounds]
        else:  # (a token would straddle a switch: each piece encoded apart)
            self.straddled += 1
            full, cuts = self.render(messages), [len(t) for _, t in bounds]
            pieces = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)])]
            ids = [self.tok.encode(p, add_special_tokens=False) for p in pieces]
            tokens, at = [t for p in ids for t in p], np.cumsum([len(p) for p in ids])[:-1].tolist()
        tokens = (*tokens, self.eos)
        on = [*at, len(tokens)]
        return tokens, frozenset(j for a, b in zip(on[0::2], on[1::2]) for j in range(a, b))


# -- the store, through the loader --------------------------------------------------------------------------

def stored(root, seq_len, doc_mask):
    """Counter of (tokens, trained positions) per stored document, read through PackedSamples; checks that
    each document is one whole segment, labels are the next token, and the document masks."""
    docs = Counter()
    for split in ("train", "eval"):
        if not any(p["splits"][split]["samples"] for p in read_manifest(root)["parts"]):
            continue
        samples = PackedSamples(root, split, doc_mask=doc_mask)
        for i in range(len(samples)):
            tokens, labels, positions, doc_ids = (np.asarray(a) for a in samples.sample(i))
            assert len(tokens) == seq_len
            segs, at, where = samples.segments(i).tolist(), 0, []
            for _, off, n, doc, start in segs:
                assert off == at and start == 0, f"sample {i}: a conversation cut, or segments not in order"
                where += [(doc, k) for k in range(n)]
                if doc_mask:
                    assert positions[off:off + n].tolist() == list(range(n)), f"sample {i}: positions of doc {doc}"
                    assert len(set(doc_ids[off:off + n].tolist())) == 1
                at += n
            if doc_mask:
                firsts = [doc_ids[off] for _, off, *_ in segs]
                assert len(set(firsts)) == len(firsts), f"sample {i}: two conversations share a document id"
            trained = {}
            for t in np.flatnonzero(labels != IGNORE).tolist():
                assert t + 1 < at and labels[t] == tokens[t + 1], f"sample {i}: label {t} past the documents"
                doc, k = where[t + 1]
                trained.setdefault(doc, set()).add(k)
            assert samples.label_count([i]) == int((labels != IGNORE).sum())
            for _, off, n, doc, _ in segs:
                docs[(tuple(tokens[off:off + n].tolist()), frozenset(trained.get(doc, ())))] += 1
    return docs


def build(tmp_path, folder, records, rng, seq_len, answers, long, held):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "id": i}) + "\n" for i, m in enumerate(records)),
                    encoding="utf-8")
    kw = {"dedup": rng.choice(["none", "exact"]), "strategy": rng.choice(["bfd", "datasculpt"]),
          "eval_fraction": 0.3 if held != "none" else 0.0, "seed": rng.randint(0, 99),
          "holdout_tokens": seq_len * rng.randint(1, 3) if held == "grid" else 0,
          "tokenizer": str(folder / "tokenizer.json"), "messages_field": "messages", "answers": answers,
          "long_conversations": long, "stats": False}
    return kw, build_store(opts([path], tmp_path / "store", seq_len=seq_len, **kw), log=quiet)


@pytest.mark.parametrize("seed", SEEDS)
def test_conversations_store_as_documented(tmp_path, folders, seed):
    rng = random.Random(seed)
    paths, tok = folders
    seq_len = rng.choice([96, 128, 160, 256])
    answers, long = rng.choice(["all", "all", "last"]), rng.choice(["truncate", "truncate", "drop"])
    records = corpus(rng, seq_len)
    ref = Reference(tok, answers, seq_len, long)
    expected = [d for d in (ref.document(m) for m in records) if d is not None]
    held = rng.choice(["none", "fraction", "grid"]) if len(expected) > 3 else "none"
    folder = paths[rng.choice(["config", "jinja"])]
    if not expected:
        with pytest.raises(DataError, match="no usable document|longer than --seq-len"):
            build(tmp_path, folder, records, rng, seq_len, answers, long, held)
        return
    kw, manifest = build(tmp_path, folder, records, rng, seq_len, answers, long, held)
    want, truncated = Counter(expected), Counter(ref.truncated)
    if kw["dedup"] == "exact":  # (one of each stored document; the copies of a cut conversation: one cut)
        want, truncated = Counter(set(expected)), Counter(set(ref.truncated))
    for doc_mask in (True, False):
        got = stored(tmp_path / "store", seq_len, doc_mask)
        assert got == want, (f"seed {seed} {kw} doc_mask={doc_mask}: missing {list((want - got).items())[:2]}, "
                             f"unexpected {list((got - want).items())[:2]}")
    counts = [p.get("stages", {}).get("tokenize", {}).get("conversations_truncated", 0)
              for p in manifest["parts"]]
    assert sum(counts) == sum(truncated.values()), f"seed {seed}: conversations_truncated"


def test_a_conversation_is_cut_where_its_answer_and_the_eos_just_fit(tmp_path, folders):
    """The edges random lengths rarely hit: a first answer whose shorter conversation ends one or two tokens
    before, at, or past the sample's end with its EOS (a long second exchange after it): cut after it where
    it fits with its EOS, dropped where it does not."""
    paths, tok = folders
    seq_len, rng = 96, random.Random(0)
    ref = Reference(tok, "all", seq_len, "truncate")
    long_tail = [{"role": "user", "content": "more"}, {"role": "assistant", "content": " ".join(["class"] * 80)}]
    records, ends = [], set()
    for k, tail in ((k, tail) for k in range(1, 60) for tail in ("", " ?", " 1", " Ω")):
        msgs = [{"role": "user", "content": " ".join(["x"] * k) + tail}, {"role": "assistant", "content": "the end"}]
        end = len(ref.ids(msgs)) + 1  # (the shorter conversation stored, with its EOS)
        if seq_len - 2 <= end <= seq_len + 2 and end not in ends:
            ends.add(end)
            records.append(msgs + long_tail)
    assert ends == set(range(seq_len - 2, seq_len + 3))
    records.append([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    expected = [d for d in (ref.document(m) for m in records) if d is not None]
    assert sorted(len(d[0]) for d in expected)[-3:] == [seq_len - 2, seq_len - 1, seq_len]
    build(tmp_path, paths["config"], records, rng, seq_len, "all", "truncate", "none")
    assert stored(tmp_path / "store", seq_len, True) == Counter(expected)
