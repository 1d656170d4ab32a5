"""Regressions from an audit of the build path: documents a build must neither lose nor change.

A tokenizer.json's own truncation / padding settings, literal special-token strings in a document,
a resumed build whose inputs or options changed, a lone surrogate in JSON, short documents and
indentation under dedup, near duplicates in text without spaces."""

import json
import os
import random

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from longctx.data.builder import pipeline
from longctx.data.builder.dedup import deduplicate, exact_hash, jaccard, shingle_hashes
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.store import read_manifest
from longctx.data.tokenizer import HFTokenizer


def quiet(*_):
    pass


def opts(inputs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 1)
    kw.setdefault("seq_len", 512)
    kw.setdefault("stats", False)
    kw.setdefault("strategy", "concat")
    kw.setdefault("dedup", "none")
    return BuildOptions(inputs=[str(i) for i in inputs], out=str(out), **kw)


def store_docs(root):
    """{doc id: tokens} from both splits of every part."""
    m = read_manifest(root)
    pieces = {}
    for part in m["parts"]:
        d = root / part["dir"]
        for split in ("train", "eval"):
            if not part["splits"][split]["samples"]:
                continue
            tok = np.load(d / f"{split}.tokens.npy")
            for s, off, n, doc, start in np.load(d / f"{split}.segments.npy").tolist():
                pieces.setdefault(doc, []).append((start, tok[s, off:off + n].tolist()))
    return {doc: [t for _, p in sorted(ps) for t in p] for doc, ps in pieces.items()}


def words(rng, n):
    return " ".join(f"w{rng.randrange(3000)}" for _ in range(n))


def word_tokenizer(path, texts, truncate=0, pad=False):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>", "<pad>"]))
    if truncate:
        tok.enable_truncation(max_length=truncate)
    if pad:
        tok.enable_padding(pad_id=2, pad_token="<pad>", length=400)
    tok.save(str(path))
    return path


def jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


# -- 1. a tokenizer.json's truncation and padding -------------------------------------------------

def test_a_tokenizer_files_truncation_and_padding_do_not_cut_or_pad_documents(tmp_path):
    rng = random.Random(0)
    texts = [words(rng, 300) for _ in range(6)]
    jsonl(tmp_path / "in/a.jsonl", texts)
    for name, kw in (("trunc", {"truncate": 64}), ("pad", {"pad": True})):
        spec = str(word_tokenizer(tmp_path / f"{name}.json", texts, **kw))
        tok = HFTokenizer(spec)
        assert [len(x) for x in tok.encode_batch(texts[:2])] == [300, 300]
        assert len(tok.encode(texts[0])) == 300
        m = build_store(opts([tmp_path / "in"], tmp_path / f"s_{name}", tokenizer=spec), log=quiet)
        assert sorted({len(v) for v in store_docs(tmp_path / f"s_{name}").values()}) == [301]  # + EOS
        assert m["totals"]["tokens"] == 301 * 6


# -- 2. a literal special-token string inside a document ------------------------------------------

def test_a_literal_special_token_string_in_a_document_is_text_not_the_token(tmp_path):
    rng = random.Random(0)
    texts = [words(rng, 50) for _ in range(4)]
    texts[1] = "the model stops at </s> when done " + words(rng, 20)
    jsonl(tmp_path / "in/a.jsonl", texts)
    spec = str(word_tokenizer(tmp_path / "tok.json", texts))
    tok = HFTokenizer(spec)
    eos = tok.eos_id
    assert eos not in tok.encode_batch([texts[1]])[0].tolist()
    m = build_store(opts([tmp_path / "in"], tmp_path / "s", tokenizer=spec), log=quiet)
    assert m["tokenizer"]["eos_id"] == eos
    for t in store_docs(tmp_path / "s").values():
        assert t[-1] == eos and eos not in t[:-1]
    # a prompt (generate / eval) keeps the tokenizer's usual behaviour, as transformers does
    assert eos in tok.encode("stop at </s> here").tolist()


# -- 3. a resumed build whose inputs or options changed -------------------------------------------

def test_a_resume_rescans_when_max_docs_changed(tmp_path):
    rng = random.Random(0)
    for f in range(3):
        jsonl(tmp_path / f"in/f{f}.jsonl", [words(rng, 40) for _ in range(20)])
    out = tmp_path / "s"
    pipeline.scan_inputs(opts([tmp_path / "in"], out, max_docs=5), out / pipeline.WORK, (0, 1), quiet)
    m = build_store(opts([tmp_path / "in"], out), log=quiet)  # interrupted after the scan, run again
    assert m["parts"][0]["counts"]["documents_read"] == 60 and m["totals"]["documents"] == 60


def test_a_resume_rescans_a_file_changed_in_place(tmp_path):
    f = tmp_path / "in/a.txt"
    f.parent.mkdir()
    f.write_text("old text of the document, version 1\n")
    out = tmp_path / "s"
    pipeline.scan_inputs(opts([tmp_path / "in"], out), out / pipeline.WORK, (0, 1), quiet)
    st = f.stat()
    f.write_text("NEW text of the document, version 2\n")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    build_store(opts([tmp_path / "in"], out), log=quiet)
    (doc,) = store_docs(out).values()
    assert bytes(t for t in doc if t < 256).decode() == "NEW text of the document, version 2\n"


def test_a_resume_rescans_when_the_tokenizer_file_changed(tmp_path):
    rng = random.Random(0)
    texts = [words(rng, 30) for _ in range(3)]
    jsonl(tmp_path / "in/a.jsonl", texts)
    spec = word_tokenizer(tmp_path / "tok.json", texts)
    out = tmp_path / "s"
    pipeline.scan_inputs(opts([tmp_path / "in"], out, tokenizer=str(spec)), out / pipeline.WORK, (0, 1), quiet)
    word_tokenizer(spec, list(reversed(texts)) + ["zz " * 50])  # another vocabulary, same path
    want = [HFTokenizer(str(spec)).encode_batch([t])[0].tolist() for t in texts]
    build_store(opts([tmp_path / "in"], out, tokenizer=str(spec)), log=quiet)
    got = sorted(t[:-1] for t in store_docs(out).values())
    assert got == sorted(want)


# -- 4. a lone surrogate ----------------------------------------------------------------------------

def test_a_lone_surrogate_in_json_is_a_counted_skip(tmp_path):
    rng = random.Random(0)
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in/a.jsonl", "w") as f:
        for _ in range(5):
            f.write(json.dumps({"text": words(rng, 30)}) + "\n")
        f.write('{"text": "a lone surrogate \\ud800 in an otherwise fine document"}\n')
    for dedup in ("minhash", "exact", "none"):
        m = build_store(opts([tmp_path / "in"], tmp_path / f"s_{dedup}", dedup=dedup), log=quiet)
        assert m["totals"]["documents"] == 5
        assert m["parts"][0]["counts"]["skipped"] == {"invalid_utf8": 1}


# -- 5-7. dedup -------------------------------------------------------------------------------------

def test_short_documents_with_the_same_words_in_another_order_are_not_near_duplicates():
    for a, b in (("dog bites man", "man bites dog"), ("Alice paid Bob", "Bob paid Alice"),
                 ("return a / b", "return b / a")):
        assert jaccard(shingle_hashes(a), shingle_hashes(b)) == 0.0
        assert deduplicate([a, b], "minhash").keep.tolist() == [True, True]
    assert deduplicate(["dog bites man", "dog  bites\nman"], "minhash").keep.tolist() == [True, False]


def test_exact_dedup_keeps_code_that_differs_in_indentation():
    a = "def f(xs):\n    for x in xs:\n        if x:\n            log(x)\n    return len(xs)\n"
    b = "def f(xs):\n    for x in xs:\n        if x:\n            log(x)\n            return len(xs)\n"
    assert deduplicate([a, b], "exact").keep.tolist() == [True, True]
    # line ends and trailing whitespace alone still make an exact copy
    assert exact_hash(a) == exact_hash(a.replace("\n", "  \r\n")) == exact_hash(a + "\n\n")
    assert exact_hash("a b") != exact_hash("a  b")


def test_near_duplicates_are_found_in_text_without_spaces():
    rng = random.Random(5)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]
    a = "".join(rng.choice(chars) for _ in range(3000)) + "。"
    b = a[:1500] + "的" + a[1501:]
    assert deduplicate([a, b], "minhash").keep.tolist() == [True, False]
    thai = "".join(rng.choice([chr(c) for c in range(0x0E01, 0x0E2F)]) for _ in range(2000))
    assert deduplicate([thai, thai[:1000] + "ก" + thai[1001:]], "minhash").keep.tolist() == [True, False]
    other = "".join(rng.choice(chars) for _ in range(3000))
    assert deduplicate([a, other], "minhash").keep.tolist() == [True, True]


# -- the default store's cache ----------------------------------------------------------------------

def test_a_builder_that_keeps_other_documents_does_not_reuse_a_cached_default_store(tmp_path, monkeypatch):
    from longctx.config.schema import DataConfig
    from longctx.data import default_store
    from longctx.data.builder import scan

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    jsonl(tmp_path / "corpus/a.jsonl", [words(random.Random(0), 40) for _ in range(3)])
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), tokenizer="byte", strategy="concat")
    first = default_store.default_store(cfg, 128, log=quiet)
    assert default_store.default_store(cfg, 128, log=quiet) == first
    monkeypatch.setattr(default_store, "SCAN_VERSION", scan.VERSION + 1)
    assert default_store.default_store(cfg, 128, log=quiet) != first
