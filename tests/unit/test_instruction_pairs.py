"""Instruction data (`data build --response-field`): each record a prompt and a response, trained on the
response's tokens (and the EOS) only. The build records each document's first token trained on
(store.LOSS_FROM); the loader turns every other label into IGNORE, in both splits, with and without
document masks, also where a document is cut across samples; label_count agrees with the labels."""

import json

import numpy as np
import pytest
from test_data_build import opts, quiet, store_documents
from test_eval_prompt_prefix import _bos_tokenizer
from tokenizers import Tokenizer

from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.data.samples import IGNORE
from longctx.data.store import LOSS_FROM, read_manifest
from longctx.data.store_identity import store_identity
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import DataError

PAIRS = [(f"Question {i}: what is {i} + {i}?\nAnswer:", f" {2 * i}, since {i} + {i} = {2 * i}." * (1 + i % 3))
         for i in range(40)]


def _jsonl(path, pairs, prompt="prompt", response="response"):
    path.write_text("".join(json.dumps({prompt: p, response: r}) + "\n" for p, r in pairs))
    return path


def _build(tmp_path, inputs, seq_len=256, name="store", **kw):
    kw = {"dedup": "none", "strategy": "bfd", "eval_fraction": 0.3, "text_field": "prompt",
          "response_field": "response", **kw}
    return tmp_path / name, build_store(opts(inputs, tmp_path / name, seq_len=seq_len, **kw), log=quiet)


def _targets(samples):
    """{(doc, index in the document)} of every labelled target token of every sample, from the segment
    index (a loop over tokens, apart from the loader's arithmetic); and the labels' count per sample."""
    found, counts = set(), []
    for i in range(len(samples)):
        tokens, labels, _, _ = samples.sample(i)
        where = [(doc, start + k) for _, _, n, doc, start in samples.segments(i).tolist() for k in range(n)]
        for t in np.flatnonzero(labels != IGNORE).tolist():
            assert labels[t] == tokens[t + 1]
            found.add(where[t + 1])
        counts.append(int((labels != IGNORE).sum()))
        assert samples.label_count([i]) == counts[-1]
    return found, counts


def _prompt_tokens(tok, prompt):
    return len(tok.text_prefix()) + len(tok.encode(prompt)) if prompt else len(tok.text_prefix())


@pytest.mark.parametrize("doc_mask", [True, False])
def test_only_the_responses_and_their_eos_are_targets(tmp_path, doc_mask):
    root, manifest = _build(tmp_path, [_jsonl(tmp_path / "sft.jsonl", PAIRS)])
    assert manifest["version"] == 3 and manifest["parts"][0]["counts"]["response_only_documents"] == len(PAIRS)
    docs, tok = store_documents(root), load_tokenizer("byte")
    names = [json.loads(x)["name"] for x in (root / "part-00000" / "docs.jsonl").read_text().splitlines()]
    expected = set()
    for doc, tokens in docs.items():
        prompt, response = PAIRS[int(names[doc].rsplit(":", 1)[1]) - 1]
        first = _prompt_tokens(tok, prompt)
        assert tokens == [*tok.encode(prompt), *tok.encode(response), tok.eos_id]
        expected |= {(doc, j) for j in range(first, len(tokens))}  # the response's tokens and the EOS
    found = set()
    for split in ("train", "eval"):
        targets, counts = _targets(PackedSamples(root, split, doc_mask=doc_mask))
        assert sum(counts) > 0
        found |= targets
    assert found == expected  # no document is cut at 256 tokens: each response token is a target once


def long_plain_store(tmp_path):
    """A concat store of 6 plain documents of ~400 tokens, cut across samples of 64: (root, its documents)."""
    docs_in = tmp_path / "in"
    docs_in.mkdir()
    for i in range(6):
        (docs_in / f"{i}.txt").write_text("line of context\n" * (20 + i) + f"Answer {i}\n" * 3)
    root, _ = _build(tmp_path, [docs_in], seq_len=64, strategy="concat", eval_fraction=0.0, response_field="",
                     text_field="text")
    return root, store_documents(root)


def test_a_document_cut_across_samples_keeps_its_prompt_out_of_the_loss(tmp_path):
    """The loader's side where a document with a first token trained on is cut across samples (a build
    keeps a pair whole, so the store is a concat one of long plain documents given a LOSS_FROM by hand)."""
    root, docs = long_plain_store(tmp_path)
    firsts = np.array([len(docs[d]) - 7 * (d + 2) for d in range(len(docs))], dtype=np.int64)
    np.save(root / "part-00000" / LOSS_FROM, firsts)
    for doc_mask in (True, False):
        samples = PackedSamples(root, "train", doc_mask=doc_mask)
        segments = [samples.segments(i).tolist() for i in range(len(samples))]
        starts = {(doc, start) for segs in segments for _, _, _, doc, start in segs}
        found, _ = _targets(samples)
        # the first token of each piece is no target with document masks (its context is in another sample);
        # without them it is, but for a sample's very first token
        firsts_of_samples = {(segs[0][3], segs[0][4]) for segs in segments}
        skip = starts if doc_mask else firsts_of_samples
        expected = {(d, j) for d in docs for j in range(firsts[d], len(docs[d])) if (d, j) not in skip}
        assert len(samples) > len(docs) and any(firsts[d] > s > 0 for d, s in starts) and found == expected


def test_pairs_longer_than_a_sample_are_dropped_and_counted(tmp_path):
    pairs = [("short?", " yes"), ("x" * 300 + "?", " long"), ("y" * 500 + "?", " longer")]
    said = []
    manifest = build_store(opts([_jsonl(tmp_path / "p.jsonl", pairs)], tmp_path / "s", seq_len=128, dedup="none",
                                strategy="bfd", eval_fraction=0.0, text_field="prompt", response_field="response"),
                           log=said.append)
    assert manifest["parts"][0]["counts"]["skipped"] == {"pair_longer_than_sample": 2}
    assert manifest["parts"][0]["counts"]["documents_kept"] == 1
    assert any("dropped 2 instruction pair(s) longer than a sample of 128 tokens (the longest 509)" in x for x in said)
    with pytest.raises(DataError, match="every document is an instruction pair longer than --seq-len 128"):
        build_store(opts([_jsonl(tmp_path / "q.jsonl", pairs[1:])], tmp_path / "t", seq_len=128, dedup="none",
                         strategy="bfd", eval_fraction=0.0, text_field="prompt", response_field="response"), log=quiet)


def test_prompt_and_response_are_encoded_apart_after_the_tokenizers_prefix(tmp_path):
    _bos_tokenizer(tmp_path / "tokenizer.json")  # (the small BPE one with a BOS its post-processor adds)
    spec = str(tmp_path / "tokenizer.json")
    pairs = [("def f(x):\n    return", " x + 1\n"), ("import", " os\nprint(os.getcwd())\n"), ("", "class A:\n")]
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "code.jsonl", pairs)], tokenizer=spec, eval_fraction=0.0)
    tok = load_tokenizer(spec)
    firsts, docs = np.load(root / "part-00000" / LOSS_FROM), store_documents(root)
    expected = set()
    for doc, (prompt, response) in enumerate(pairs):  # (one file, read in order, nothing removed)
        # "return" + " x" would merge into one token if the pair were encoded joined: apart, they never do
        assert docs[doc] == [*tok.text_prefix(), *tok.encode(prompt), *tok.encode(response), tok.eos_id]
        assert firsts[doc] == 1 + len(tok.encode(prompt))  # (an empty prompt: the BOS alone is not trained on)
        expected |= {(doc, j) for j in range(firsts[doc], len(docs[doc]))}
    assert _targets(PackedSamples(root, "train"))[0] == expected


def test_plain_documents_beside_pairs_train_whole_and_a_plain_store_is_unchanged(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("a plain document, every token of it trained on\n")
    root, manifest = _build(tmp_path, [_jsonl(tmp_path / "sft.jsonl", PAIRS[:5]), plain], eval_fraction=0.0)
    firsts = np.load(root / "part-00000" / LOSS_FROM)
    assert sorted(firsts.tolist())[0] == 0 and np.count_nonzero(firsts) == 5
    # appended: plain documents only, as a part of their own; the store keeps the version of its pairs
    more = tmp_path / "more"
    more.mkdir()
    (more / "b.txt").write_text("another plain document\n")
    appended = build_store(opts([more], root, seq_len=256, dedup="none", strategy="bfd", append=True), log=quiet)
    assert appended["version"] == 3 and not (root / "part-00001" / LOSS_FROM).exists()
    _targets(PackedSamples(root, "train"))  # (label counts agree with the labels across both parts)
    alone, manifest = _build(tmp_path, [plain], name="alone", response_field="", text_field="text", eval_fraction=0.0)
    assert manifest["version"] == 2 and not (alone / "part-00000" / LOSS_FROM).exists()


def test_a_prompt_moved_into_the_response_is_another_store(tmp_path):
    """The same texts, split elsewhere (the same input file rewritten): the documents' hashes, names and
    counts agree, what is trained on does not, and a resume must know it."""
    source = _jsonl(tmp_path / "a.jsonl", [("Q: 1 + 1?", " A: 2")])
    a, _ = _build(tmp_path, [source], name="a", eval_fraction=0.0)
    _jsonl(source, [("Q: 1 + 1? A:", " 2")])
    b, _ = _build(tmp_path, [source], name="b", eval_fraction=0.0)
    assert store_documents(a) == store_documents(b)
    assert read_manifest(a)["parts"][0]["counts"] == read_manifest(b)["parts"][0]["counts"]
    assert store_identity(read_manifest(a), a) != store_identity(read_manifest(b), b)


def test_records_without_a_response_are_counted_skips_and_parquet_pairs_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = [json.dumps(r) for r in ({"prompt": "p", "response": " r"}, {"prompt": "p only"},
                                     {"prompt": "p", "response": 3}, {"prompt": "p", "response": "  "},
                                     {"response": "no prompt field"})]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"prompt": ["2 + 2 =", "3 + 3 ="], "response": [" 4", " 6"]}), tmp_path / "t.parquet")
    root, manifest = _build(tmp_path, [tmp_path / "mixed.jsonl", tmp_path / "t.parquet"], eval_fraction=0.0)
    skipped = manifest["parts"][0]["counts"]["skipped"]
    assert skipped == {"missing_response_field": 2, "empty": 1, "missing_text_field": 1}, skipped
    assert sorted(store_documents(root).values()) == sorted(
        [[*b"p r", 257], [*b"2 + 2 = 4", 257], [*b"3 + 3 = 6", 257]])
    with pytest.raises(DataError, match="has no column 'answer'.*--response-field"):
        _build(tmp_path, [tmp_path / "t.parquet"], name="missing", response_field="answer")


@pytest.mark.parametrize("kw,message", [
    ({"text_field": "text", "response_field": "text"}, "--response-field 'text' is the --text-field too"),
    ({"strategy": "concat"}, "--strategy concat cuts documents wherever a sample ends"),
    ({"holdout_tokens": 128}, "--holdout-tokens 128 below --seq-len 256 would hold out pieces of an instruction"),
])
def test_options_that_would_train_a_response_without_its_prompt_are_refused_before_work(tmp_path, kw, message):
    with pytest.raises(DataError, match=message):
        _build(tmp_path, [_jsonl(tmp_path / "x.jsonl", PAIRS[:2])], **kw)
    assert not (tmp_path / "store").exists()


def test_a_ranks_share_of_positions_reads_the_same_labels_as_the_whole_batch(tmp_path):
    """What a sequence-parallel rank reads (read_at on its positions, parallel/context/shares.py) holds the
    whole batch's labels at those positions: the prompts stay out of the loss on every rank."""
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "sft.jsonl", PAIRS)], eval_fraction=0.0)
    samples = PackedSamples(root, "train")
    indices = list(range(min(4, len(samples))))
    whole, frames = samples.batch(indices), samples.frames(indices)
    rng = np.random.default_rng(0)
    held = np.stack([np.sort(rng.choice(samples.seq_len, samples.seq_len // 4, replace=False)) for _ in indices])
    part = samples.read_at(indices, frames, held)
    assert np.array_equal(part.labels.numpy(), np.take_along_axis(whole.labels.numpy(), held, 1))
    segments = sum(len(samples.segments(i)) for i in indices)
    plain = int(frames.real.sum()) - segments  # what documents trained on whole would have
    assert 0 < (whole.labels != IGNORE).sum() == samples.label_count(indices) < plain


def test_a_rendered_chat_prompt_reads_its_special_tokens_as_the_model_does(tmp_path):
    """A prompt rendered with a chat template holds special-token strings: in a pair they are the special
    tokens (as `longctx generate` encodes a prompt), and a prompt that begins with the BOS's string gets no
    second BOS; in a plain document they stay text."""
    path = tmp_path / "tokenizer.json"
    _bos_tokenizer(path)
    t = Tokenizer.from_file(str(path))
    t.add_special_tokens(["<|start|>", "<|end|>"])
    t.save(str(path))
    start, end, bos = (t.token_to_id(x) for x in ("<|start|>", "<|end|>", "<s>"))
    prompt, response = "<|start|>user\nimport os?<|end|><|start|>assistant\n", "print(os.getcwd())<|end|>"
    pairs = [(prompt, response), ("<s>" + prompt, response)]
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "chat.jsonl", pairs)], tokenizer=str(path), eval_fraction=0.0)
    tok = load_tokenizer(str(path))
    docs = store_documents(root)
    for doc, text in enumerate((prompt, "<s>" + prompt)):
        expected_prompt = [bos, *tok.encode(prompt)] if doc == 0 else [*tok.encode(text)]  # (<s> read as the BOS)
        assert docs[doc][:len(expected_prompt)] == expected_prompt and docs[doc].count(bos) == 1
        assert docs[doc].count(start) == 2 and docs[doc].count(end) == 2  # the response's end of turn too
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "doc.txt").write_text(prompt)
    alone, _ = _build(tmp_path, [plain], name="alone", tokenizer=str(path), eval_fraction=0.0, response_field="",
                      text_field="text")
    assert start not in store_documents(alone)[0]


def test_a_response_is_encoded_as_it_reads_after_its_prompt(tmp_path):
    """A Llama-2 / Mistral tokenizer (its normalizer's Prepend('▁')) encoding " there was a cat." alone
    starts it with a second word boundary, '▁▁there'; the store holds the tokens that follow a prompt."""
    from test_prompt_ids_audit import _sentencepiece

    spec = str(_sentencepiece(tmp_path / "sp") / "tokenizer.json")
    pairs = [("Once upon a time", " there was a cat."), ("", "Once upon a time")]
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "sp.jsonl", pairs)], tokenizer=spec, eval_fraction=0.0)
    tok, docs = load_tokenizer(spec), store_documents(root)
    firsts = np.load(root / "part-00000" / LOSS_FROM)
    # decoded (the BOS and EOS left out), the stored tokens are the text: one space between prompt and response
    assert tok.decode(docs[0][1:-1]) == "Once upon a time there was a cat."
    alone = tok.encode(" there was a cat.").tolist()
    assert tok.decode([*docs[0][1:firsts[0]], *alone]) == "Once upon a time  there was a cat."  # (encoded alone)
    # an empty prompt: the response begins the document, encoded as a document's start is
    assert docs[1] == [*tok.encode("Once upon a time", add_special_tokens=True).tolist(), tok.eos_id]


def test_a_pair_store_with_a_synthetic_mixture_trains(tmp_path):
    from longctx.config import load_config
    from longctx.train.setup import build_data

    root, _ = _build(tmp_path, [_jsonl(tmp_path / "sft.jsonl", PAIRS)], eval_fraction=0.0)
    said = []
    cfg = load_config(overrides=["--train.seq_len=256", f"--data.path={root}", "--data.synthetic=passkey:0.2"])
    train, _ = build_data(cfg, log=said.append)
    assert any(f"{len(PAIRS)} trained on their responses only" in x for x in said) and len(train) > 0


@pytest.mark.parametrize("damage", ["missing", "longer", "shorter"])
def test_a_part_whose_loss_from_is_missing_or_of_another_length_is_refused(tmp_path, damage):
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "sft.jsonl", PAIRS)], eval_fraction=0.0)
    path = root / "part-00000" / LOSS_FROM
    firsts = np.load(path)
    if damage == "missing":
        path.unlink()
    else:
        np.save(path, np.r_[firsts, 1] if damage == "longer" else firsts[:-1])
    found = "is missing" if damage == "missing" else f"holds {len(PAIRS) + (1 if damage == 'longer' else -1)} documents"
    with pytest.raises(DataError, match=f"is damaged: .*{LOSS_FROM} {found}, its manifest {len(PAIRS)} "):
        PackedSamples(root, "train")


def test_dedup_a_dropped_pair_and_an_append_keep_each_document_with_its_own_first_token(tmp_path):
    """Documents removed before others (an exact duplicate, a pair longer than a sample, right after a plain
    document) and a second part appended: every label of both parts is a response token of its own record
    (by the record's name), every token of the plain document's."""
    first, third, second = [*PAIRS[:6], PAIRS[2]], [("x" * 600 + "?", " too long"), *PAIRS[6:12]], PAIRS[12:20]
    a, plain, c, more = (tmp_path / n for n in ("a.jsonl", "b_plain", "c.jsonl", "more"))
    plain.mkdir()
    (plain / "note.txt").write_text("a plain document between the two files of pairs\n")
    more.mkdir()
    _jsonl(a, first), _jsonl(c, third), _jsonl(more / "d.jsonl", second)
    root, manifest = _build(tmp_path, [a, plain, c], dedup="exact", eval_fraction=0.0)
    assert manifest["parts"][0]["counts"]["skipped"] == {"pair_longer_than_sample": 1}
    build_store(opts([more], root, seq_len=256, dedup="exact", strategy="bfd", eval_fraction=0.0, append=True,
                     text_field="prompt", response_field="response"), log=quiet)
    records = ({f"a.jsonl:{i}": p for i, p in enumerate(first, 1)} | {f"c.jsonl:{i}": p for i, p in enumerate(third, 1)}
               | {f"d.jsonl:{i}": p for i, p in enumerate(second, 1)} | {"note.txt": ("", "")})
    names = [json.loads(x)["name"] for part in ("part-00000", "part-00001")
             for x in (root / part / "docs.jsonl").read_text().splitlines()]
    assert len(names) == 6 + 1 + 6 + 8  # (the repeat and the long pair gone)
    tok, docs = load_tokenizer("byte"), store_documents(root)
    expected = {(doc, j) for doc, tokens in docs.items()
                for j in range(max(1, _prompt_tokens(tok, records[names[doc]][0])), len(tokens))}
    assert _targets(PackedSamples(root, "train"))[0] == expected  # (a document's first token is no one's target)
