"""Audit findings (data pipeline): a non-UTF-8 file name, the holdout fallback on a grid shorter than a sample,
and a tokenizer file changed under an append or a merge."""

import json
import os

import numpy as np
import pytest

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.store import load_split, read_manifest
from longctx.errors import DataError


def _build(inputs, out, **kw):
    return build_store(BuildOptions(inputs=[str(i) for i in inputs], out=str(out), progress=False, workers=1, **kw),
                       log=lambda *a: None)


def test_a_file_name_that_is_not_utf8_is_held_out_by_its_bytes(tmp_path):
    d = os.fsencode(tmp_path / "in")
    os.makedirs(d)
    with open(d + b"/caf\xe9.txt", "wb") as f:
        f.write(b"hello world this is a latin-1 named file with some text\n")
    with open(d + b"/ok.txt", "wb") as f:
        f.write(b"another perfectly fine document with words\n")
    m = _build([os.fsdecode(d)], tmp_path / "s", seq_len=64, eval_fraction=0.5)
    assert m["totals"]["documents"] == 2


def _tokens_of(root, manifest):
    out = {}
    for part in manifest["parts"]:
        for split in ("train", "eval"):
            a = load_split(root, part, split)
            for s, off, ln, doc, st in (a.segments.tolist() if a is not None else []):
                out.setdefault(doc, []).append((st, np.asarray(a.tokens[s, off:off + ln]).tolist()))
    return {d: [t for _, p in sorted(v) for t in p] for d, v in out.items()}


def test_the_holdout_fallback_holds_out_a_whole_document_that_fits_a_sample(tmp_path):
    (tmp_path / "in").mkdir()
    texts = [f"first half line {i} ".ljust(24, "a") + "\n" + f"second half {i} ".ljust(25, "b") for i in range(3)]
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # nothing hashes in at 0.004; the lowest-hash piece is a.jsonl:1's second (grid 32 < its 51 tokens <= 64)
    m = _build([tmp_path / "in"], tmp_path / "s", seq_len=64, holdout_tokens=32, eval_fraction=0.004, dedup="none")
    assert m["parts"][0]["splits"]["eval"]["documents"] == 1
    got = _tokens_of(tmp_path / "s", m)
    assert [got[i] for i in range(3)] == [list(t.encode()) + [257] for t in texts]


def _tokenizer(path, corpus, vocab, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials))
    tok.save(str(path))


@pytest.mark.parametrize("how", ["append", "merge"])
def test_a_tokenizer_file_changed_since_the_store_or_scans_is_refused(tmp_path, how):
    texts = [f"def foo{i}(): return bar{i} and baz" for i in range(30)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = tmp_path / "tokenizer.json"
    _tokenizer(tok, texts, 80, ["<unk>", "<|endoftext|>"])
    opts = dict(seq_len=64, tokenizer=str(tok), eval_fraction=0.1)
    if how == "append":
        _build([tmp_path / "in"], tmp_path / "s", **opts)
    else:
        scans = [str(tmp_path / f"scan{i}") for i in range(2)]
        for i, d in enumerate(scans):
            _build([tmp_path / "in"], d, shard=(i, 2), **opts)
    _tokenizer(tok, ["completely other text zzz qqq"], 60, ["<s>", "</s>", "<unk>", "<|endoftext|>"])
    (tmp_path / "in2").mkdir()
    (tmp_path / "in2" / "b.jsonl").write_text(json.dumps({"text": "new text to add"}) + "\n")
    with pytest.raises(DataError, match="changed since"):
        if how == "append":
            _build([tmp_path / "in2"], tmp_path / "s", append=True, **opts)
        else:
            merge_scans(scans, str(tmp_path / "s"), progress=False, log=lambda *a: None)
    if how == "append":
        assert len(read_manifest(tmp_path / "s")["parts"]) == 1
