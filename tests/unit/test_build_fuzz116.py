"""A randomized audit of `longctx data build` against an independent reference (tests/build_reference.py: what
the docs say a store of a corpus holds, computed without the builder's code).

Seeded random corpora (text files with CRLF, BOMs, decomposed Unicode, trailing white space, names in a
subdirectory or not UTF-8; empty, white-space-only, binary, non-UTF-8 and unread files; documents many samples
long with and without line breaks; .jsonl and .jsonl.gz records with blank, bad and text-less lines; copies
exact or spaced otherwise) are built with random options (seq_len, strategy, dedup, eval fraction, holdout grid,
--max-docs, the byte tokenizer or a small BPE tokenizer.json with a BOS, packing groups of a few samples) through
`build_store`, the API `longctx data build` calls. The store is read raw (tokens, segments, docs.jsonl, counts)
and through PackedSamples, with and without document masks, and compared token for token. The last tests build
one corpus with other workers, shard sizes, --shard scans merged, and a build killed part-way and rerun (all
bitwise the same store), and append a second corpus to a store.
"""

import json
import multiprocessing as mp
import random
from pathlib import Path

import numpy as np
import pytest

from build_reference import (
    bpe_tokenizer,
    expected_segments,
    kept_documents,
    make_corpus,
    normalised,
    split_reference,
    variant,
)
from longctx.data import store
from longctx.data.builder import pipeline, scan, scan_pool, spill
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.loader import PackedSamples
from longctx.data.samples import IGNORE
from longctx.errors import DataError


def quiet(*_):
    pass


# -- the store, read raw and through the loader -------------------------------------------------------------

def doc_records(root):
    """{store doc id: docs.jsonl record} over every part."""
    out = {}
    for part in store.read_manifest(root)["parts"]:
        lines = (root / part["dir"] / "docs.jsonl").read_text().splitlines()
        out.update({part["first_doc"] + i: json.loads(line) for i, line in enumerate(lines)})
    return out


def split_arrays(root, split):
    """[(tokens, segments, pointer)] of a split, one per part that holds samples."""
    out = []
    for part in store.read_manifest(root)["parts"]:
        if part["splits"][split]["samples"]:
            d = root / part["dir"]
            out.append(tuple(np.load(d / f"{split}.{what}.npy") for what in ("tokens", "segments", "samples")))
    return out


def check_split(root, split, kept, names, items, seq_len, strategy, full=True):
    """The split's samples hold exactly `items` (as the strategy cuts them), token for token; (per sample its
    tokens, its segments' lengths and whether each token is trained on, for the loader check; the segments as
    (name, start, length))."""
    got, stream, rows = [], [], []
    pad = next(iter(kept.values()))[-1]  # (the EOS)
    for tokens, segs, ptr in split_arrays(root, split):
        part_rows = len(rows)
        assert tokens.shape[1] == seq_len and len(ptr) == len(tokens) + 1 and ptr[-1] == len(segs)
        for w in range(len(tokens)):
            mine = segs[ptr[w]:ptr[w + 1]]
            assert len(mine) and (mine[:, store.S_SAMPLE] == w).all(), f"sample {w} has no or foreign segments"
            row, trained, at = [], [], 0
            for _, off, n, doc, start in mine.tolist():
                assert off == at and n > 0, f"sample {w}: a segment at {off}, expected {at}"
                name = names[doc]
                row += kept[name][start:start + n]
                trained += [i >= kept[name].loss_from for i in range(start, start + n)]
                got.append((name, start, n))
                at += n
            assert at <= seq_len, f"sample {w} overflows: {at} tokens"
            assert tokens[w].tolist() == row + [pad] * (seq_len - at), f"sample {w}: tokens are not its documents'"
            stream += row
            rows.append((row, mine[:, store.S_LENGTH].tolist(), trained))
        if strategy == "concat" and full:  # (a part is packed on its own: its last sample alone may be short)
            assert all(len(r[0]) == seq_len for r in rows[part_rows:-1]), "concat left a sample short before the last"
    if strategy == "concat":  # the items in document order, cut wherever a sample ends
        assert stream == [t for name, s, m in items for t in kept[name][s:s + m]]
    else:
        assert sorted(got) == expected_segments(kept, items, seq_len)
    return rows, got


def check_loader(root, split, rows, seq_len, pad):
    """PackedSamples reads each sample as its segments say: positions restart in each document, a label
    only inside one and only of a token trained on (a response's, instruction data), padding its own
    document, never scored, never a label; without masks, plain causal."""
    for doc_mask in (True, False):
        ps = PackedSamples(root, split, doc_mask=doc_mask)
        assert len(ps) == len(rows)
        if not rows:
            continue
        b = ps.batch(range(len(rows)))
        for w, (row, lengths, trained) in enumerate(rows):
            real = len(row)
            tokens, trained = row + [pad] * (seq_len - real), trained + [False] * (seq_len - real)
            if doc_mask:
                spans = lengths + ([seq_len - real] if real < seq_len else [])
                pos = [p for n in spans for p in range(n)]
                ids = [k for k, n in enumerate(spans) for _ in range(n)]
                ends = set(np.cumsum(lengths) - 1)
                labels = [tokens[t + 1] if t < real and t not in ends and trained[t + 1] else IGNORE
                          for t in range(seq_len)]
                assert b.doc_ids[w].tolist() == ids
            else:
                pos = list(range(seq_len))
                labels = [tokens[t + 1] if t < real - 1 and trained[t + 1] else IGNORE for t in range(seq_len)]
                assert b.doc_ids is None
            assert b.tokens[w].tolist() == tokens
            assert b.positions[w].tolist() == pos, f"sample {w}: positions"
            assert b.labels[w].tolist() == labels, f"sample {w}: labels (padding scored, or a label across documents)"
            assert b.real[w].tolist() == [t < real for t in range(seq_len)]
        assert ps.label_count(range(len(rows))) == int((b.labels != IGNORE).sum())


# -- the fuzz ---------------------------------------------------------------------------------------------

def random_options(rng, tiny=False):
    seq_len = rng.choice([7, 16, 33] if tiny else [16, 33, 64, 100, 256])
    fraction = rng.choice([0.01, 0.05, 0.3] if tiny else [0.0, 0.0, 0.2, 0.5])
    return dict(seq_len=seq_len, strategy=rng.choice(["concat", "bfd", "datasculpt"]),
                dedup=rng.choice(["none", "exact", "minhash"]), eval_fraction=fraction,
                holdout_tokens=rng.choice([0, 0, seq_len // 2, 2 * seq_len]) if fraction else 0,
                seed=rng.randrange(100), stats=rng.random() < 0.5)


def build(inputs, out, **kw):
    kw.setdefault("workers", 1)
    return build_store(BuildOptions(inputs=[str(i) for i in inputs], out=str(out), progress=False, **kw), log=quiet)


def expected_split_of(name, items):
    where = {s for s in ("train", "eval") if any(n == name for n, _, _ in items[s])}
    return "both" if len(where) == 2 else where.pop()


def check_store(root, kept, items, kw, full=True):
    """The store at `root` holds `kept` (in order, numbered from 0) split and packed as `items` say."""
    m = store.read_manifest(root)
    records = doc_records(root)
    names = {doc: r["name"] for doc, r in records.items()}
    assert list(names) == list(range(len(kept))) and list(names.values()) == list(kept), \
        "the documents kept (or their order) are not the first copies"
    assert [r["tokens"] for r in records.values()] == [len(t) for t in kept.values()]
    assert [r["split"] for r in records.values()] == [expected_split_of(n, items) for n in kept], kw
    assert m["totals"]["tokens"] == sum(map(len, kept.values()))
    loss_from = [int(x) for p in m["parts"] for x in (np.load(root / p["dir"] / store.LOSS_FROM).tolist()
                 if (root / p["dir"] / store.LOSS_FROM).exists() else [0] * p["documents"])]
    assert loss_from == [t.loss_from for t in kept.values()], "a pair is trained from elsewhere than its response"
    seen = {}
    for split in ("train", "eval"):
        rows, segments = check_split(root, split, kept, names, items[split], kw["seq_len"], kw["strategy"], full)
        assert m["totals"][f"{split}_samples"] == len(rows)
        check_loader(root, split, rows, kw["seq_len"], next(iter(kept.values()))[-1])
        for name, s, n in segments:
            for t in range(s, s + n):
                assert (name, t) not in seen, f"{name} token {t} is in {seen[(name, t)]} and {split}"
                seen[(name, t)] = split
    assert len(seen) == m["totals"]["tokens"]  # every kept token stored once, in one split


@pytest.mark.parametrize("case", range(28))
def test_a_random_corpus_builds_into_exactly_its_documents(tmp_path, monkeypatch, case):
    rng = random.Random(11600 + case)
    tiny = case % 7 == 6  # one to four documents: the eval split's fallback, a single document
    kw = random_options(rng, tiny)
    pairs = case % 3 == 2  # records as prompt and response (--response-field): the response trained on alone
    if pairs:  # (concat, and a holdout grid below a sample, would cut a pair: refused)
        seq_len = rng.choice([256, 512, 1024, 1024, 16])  # (most pairs fit; the others are dropped)
        kw.update(response_field="response", strategy=kw["strategy"].replace("concat", "bfd"), seq_len=seq_len,
                  holdout_tokens=rng.choice([0, 2 * seq_len]) if kw["eval_fraction"] else 0)
    docs, skipped = make_corpus(rng, tmp_path / "in", kw["seq_len"], tiny=tiny, pairs=pairs)
    encode = None
    if case % 4 == 1:  # a tokenizer.json: a BOS before each document, line breaks from its offsets
        encode = bpe_tokenizer(tmp_path / "tokenizer.json", [normalised(d.text) for d in docs])
        kw["tokenizer"] = str(tmp_path / "tokenizer.json")
    grouped = case % 5 == 2
    if grouped:  # packed a few samples at a time, as a corpus of many millions of tokens is
        monkeypatch.setattr(BuildOptions, "group_tokens", property(lambda o: 3 * o.seq_len))
    if case % 6 == 3:
        kw["max_docs"] = rng.randint(1, len(docs))
        docs = docs[:kw["max_docs"]]
    kept = kept_documents(docs, kw["dedup"], encode, kw["seq_len"])
    items = split_reference(kept, kw["eval_fraction"], kw["holdout_tokens"] or kw["seq_len"], kw["seq_len"])
    dropped = len(docs) - len(kept_documents(docs, "none", encode, kw["seq_len"]))  # (pairs longer than a sample)
    if dropped:
        skipped["pair_longer_than_sample"] = dropped
    try:
        m = build([tmp_path / "in"], tmp_path / "s", **kw)
    except DataError as e:
        assert not items["train"] and "every document landed in the eval split" in str(e), (kw, e)
        return
    check_store(tmp_path / "s", kept, items, kw, full=not grouped)
    counts = m["parts"][0]["counts"]
    if not kw.get("max_docs"):  # (with it, the skips before its last document: the targeted tests' matter)
        assert counts["skipped"] == {k: n for k, n in skipped.items() if n}
    assert counts["documents_read"] == len(docs)
    assert counts["exact_duplicates"] + counts["near_duplicates"] == len(docs) - dropped - len(kept)


# -- the same store however the build is run -----------------------------------------------------------------

VOLATILE = ("created", "stages")  # (a part's time of creation and its stages' seconds)


def store_bytes(root):
    """Every file of every part, and the manifest less its times."""
    m = store.read_manifest(root)
    files = {(p["dir"], f.name): f.read_bytes() for p in m["parts"] for f in sorted((root / p["dir"]).iterdir())}
    parts = [{k: v for k, v in p.items() if k not in VOLATILE} for p in m["parts"]]
    return files, {**m, "parts": parts}


def killed_at(monkeypatch, k):
    """RaggedWriter.append (a scanned document's files) raises KeyboardInterrupt on its k-th call."""
    real, calls = spill.RaggedWriter.append, []

    def append(self, *a, **kw):
        calls.append(1)
        if len(calls) == k:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(spill.RaggedWriter, "append", append)


LAYOUT_CASES = [dict(seq_len=64, strategy="datasculpt", dedup="minhash", eval_fraction=0.3, holdout_tokens=32),
                dict(seq_len=33, strategy="concat", dedup="exact", eval_fraction=0.0),
                dict(seq_len=512, strategy="bfd", dedup="minhash", eval_fraction=0.5, response_field="response"),
                dict(seq_len=100, strategy="bfd", dedup="exact", eval_fraction=0.2, max_docs=4)]


@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)))
def test_workers_shards_machines_and_a_resume_build_the_same_store(tmp_path, monkeypatch, case):
    rng = random.Random(116 + case)
    kw = LAYOUT_CASES[case]
    docs, _ = make_corpus(rng, tmp_path / "in", kw["seq_len"], pairs="response_field" in kw)
    kept = kept_documents(docs[:kw.get("max_docs") or len(docs)], kw["dedup"], None, kw["seq_len"])
    check_store(Path(build_store_at(tmp_path / "one", tmp_path / "in", kw)), kept,
                split_reference(kept, kw["eval_fraction"], kw.get("holdout_tokens") or kw["seq_len"], kw["seq_len"]),
                kw)
    want = store_bytes(tmp_path / "one")
    monkeypatch.setattr(scan, "SHARD_BYTES", 1500)  # several shards
    monkeypatch.setattr(scan_pool, "worker_context", lambda: mp.get_context("fork"))  # (the patches reach them)
    build_store_at(tmp_path / "shards", tmp_path / "in", kw)
    assert store_bytes(tmp_path / "shards") == want, "another shard size built another store"
    build_store_at(tmp_path / "workers", tmp_path / "in", {**kw, "workers": 3})
    assert store_bytes(tmp_path / "workers") == want, "other workers built another store"
    if not kw.get("max_docs"):  # (--shard and --max-docs do not go together)
        scans = [str(build_store_at(tmp_path / f"scan{i}", tmp_path / "in", {**kw, "shard": (i, 3)}) and
                     tmp_path / f"scan{i}") for i in range(3)]
        merge_scans(scans, str(tmp_path / "merged"), progress=False, log=quiet)
        assert store_bytes(tmp_path / "merged") == want, "--shard scans merged into another store"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        # (a document writes ~8 ragged files: about half-way through what the scan reads)
        killed_at(m, 4 * min(len(docs), kw.get("max_docs") or len(docs)))
        build_store_at(tmp_path / "resumed", tmp_path / "in", kw)
    assert not (tmp_path / "resumed" / store.MANIFEST).exists()
    assert list((tmp_path / "resumed" / pipeline.WORK / scan.SHARDS).glob("0*")), "nothing was scanned to resume"
    build_store_at(tmp_path / "resumed", tmp_path / "in", kw)
    assert store_bytes(tmp_path / "resumed") == want, "a build killed and rerun built another store"


def build_store_at(out, src, kw):
    return build([src], out, **kw) and out


def test_an_append_adds_exactly_the_new_documents_after_the_stored_ones(tmp_path):
    """Documents of the second corpus that the store holds already (exact or, with minhash, same words) are
    not added; the others follow the stored ones' ids, split by their own names' hashes."""
    for case, dedup in enumerate(("exact", "minhash")):
        rng = random.Random(1160 + case)
        kw = dict(seq_len=rng.choice([33, 64]), strategy=rng.choice(["bfd", "concat", "datasculpt"]), dedup=dedup,
                  eval_fraction=rng.choice([0.0, 0.3]))
        first, _ = make_corpus(rng, tmp_path / f"a{case}", kw["seq_len"], prefix="a")
        copies = [variant(rng, d.text) for d in rng.sample(first, min(3, len(first)))]
        second, _ = make_corpus(rng, tmp_path / f"b{case}", kw["seq_len"], prefix="b", copies=copies)
        root = tmp_path / f"s{case}"
        m = build([tmp_path / f"a{case}"], root, **kw)
        held = bool(m["totals"]["eval_samples"])
        m = build([tmp_path / f"b{case}"], root, append=True, **kw)
        kept_first, kept = kept_documents(first, dedup), kept_documents(first + second, dedup)
        assert [p["first_doc"] for p in m["parts"]] == [0, len(kept_first)]
        added = {name: kept[name] for name in list(kept)[len(kept_first):]}
        items = [split_reference(part, kw["eval_fraction"], kw["seq_len"], kw["seq_len"], fallback)
                 for part, fallback in ((kept_first, True), (added, not held))]
        check_store(root, kept, {s: items[0][s] + items[1][s] for s in ("train", "eval")}, kw)


@pytest.mark.parametrize("long", [False, True])
def test_an_append_holds_out_the_revision_of_the_document_the_eval_split_fell_back_to(tmp_path, long):
    """No piece hashed into the eval split: the build held out the lowest-hash one (holdout.py). A revision of
    that document appended under its name is held out as its first version was (pipeline.py, docs/data.md),
    not trained on: a store that trained on it would train on a copy of its own eval text."""
    lines = [f"line {i} of the story of apples and pears, told once more\n" for i in range(40 if long else 1)]
    texts = {"one.txt": "the first document\n", "two.txt": "".join(lines), "three.txt": "third: cherries\n"}
    kw = dict(seq_len=256, strategy="bfd", dedup="exact", eval_fraction=0.001)
    for name, text in texts.items():
        (tmp_path / "a" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "a" / name).write_text(text)
    build([tmp_path / "a"], tmp_path / "s", **kw)
    held = {r["name"]: r["split"] for r in doc_records(tmp_path / "s").values() if r["split"] != "train"}
    assert held == {"two.txt": "both" if long else "eval"}  # (the case: the fallback held it out)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text(texts["two.txt"] + "and a line added since\n")
    (tmp_path / "b" / "four.txt").write_text("a new document\n")
    build([tmp_path / "b"], tmp_path / "s", append=True, **kw)
    records = doc_records(tmp_path / "s")
    revision = next(doc for doc, r in records.items() if doc >= len(texts) and r["name"] == "two.txt")
    assert records[revision]["split"] == held["two.txt"], "the revision of an eval document is trained on"
    in_eval = sum(int(n) for _, segs, _ in split_arrays(tmp_path / "s", "eval")
                  for n, doc in segs[:, [store.S_LENGTH, store.S_DOC]].tolist() if doc == revision)
    assert 0 < in_eval <= kw["seq_len"] and (in_eval == records[revision]["tokens"]) != long
