"""A randomized audit of what `longctx data build` reads: seeded random corpora of every input format it takes
(text files, `.jsonl`, both also `.gz` / `.zst` in one or several frames, parquet, arrow stream and file) in nested
directories, a linked directory, a link back up the tree, a file linked twice, dotfiles, unsupported suffixes, built
into a store and read back, against tests/readers_fuzz117_reference.py (json / gzip / zstandard / pyarrow directly and
the normalisation docs/data.md states).

The documents hold random Unicode (combining marks that compose across piece boundaries, astral characters, lone
CR, CRLF, U+2028, a BOM at the start and in the middle, NUL) and the records null, missing, non-string, empty and
surrogate values, bad lines, BOM-led lines and CR-ended lines; some compressed files are cut short. The store's
documents (in input order, with exact dedup the first copy) must be the reference's, byte-tokenized, its skip
counts the reference's, and its damaged files named; the same corpus listed in another order, or scanned by other
workers, gives the same store bit for bit.
"""

import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from longctx.data import store
from longctx.data.builder import readers, scan
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.errors import DataError
from readers_fuzz117_reference import EOS, kept, make_corpus, read_corpus


def build(inputs, out, **kw):
    kw = {"seq_len": 64, "strategy": "concat", "dedup": "none", "eval_fraction": 0.0, "workers": 1, **kw}
    return build_store(BuildOptions(inputs=[str(i) for i in inputs], out=str(out), progress=False, **kw),
                       log=lambda *_: None)


def stored_documents(root: Path) -> dict:
    """{name: tokens} of every document of the store, in its order, put together from the samples' segments."""
    m = store.read_manifest(root)
    names, pieces = [], {}
    for part in m["parts"]:
        d = root / part["dir"]
        names += [json.loads(line)["name"] for line in (d / "docs.jsonl").read_text().splitlines()]
        for split in ("train", "eval"):
            if not part["splits"][split]["samples"]:
                continue
            tokens, segs = np.load(d / f"{split}.tokens.npy"), np.load(d / f"{split}.segments.npy")
            for w, off, n, doc, start in segs.tolist():
                pieces.setdefault(part["first_doc"] + doc if doc < part["documents"] else doc, []).append(
                    (start, tokens[w, off:off + n].tolist()))
    out = {}
    for i, name in enumerate(names):
        assert name not in out, f"document {name} stored twice"
        got, at = [], 0
        for start, toks in sorted(pieces.get(i, [])):
            assert start == at, f"{name}: a piece at token {start}, expected {at}"
            got += toks
            at += len(toks)
        out[name] = got
    return out


def first_difference(want: dict, got: dict) -> str:
    for (a, ta), (b, tb) in zip(want.items(), got.items()):
        if a != b or ta != tb:
            return f"want {a!r} {bytes(t for t in ta if t < 256)!r}, got {b!r} {bytes(t for t in tb if t < 256)!r}"
    return f"{len(want)} documents wanted, {len(got)} stored; extra: {list(want)[len(got):] or list(got)[len(want):]}"


@pytest.mark.parametrize("case", range(12))
def test_a_random_corpus_is_read_as_the_docs_say(tmp_path, case):
    rng = random.Random(117000 + case)
    corrupt = make_corpus(rng, tmp_path / "in", tmp_path / "outside")
    docs, skipped, damaged, partial = read_corpus(str(tmp_path / "in"), corrupt)
    dedup = "exact" if case % 2 else "none"
    want = kept(docs, dedup)
    if not want:
        with pytest.raises(DataError):
            build([tmp_path / "in"], tmp_path / "store", dedup=dedup)
        return
    m = build([tmp_path / "in"], tmp_path / "store", dedup=dedup)
    got = stored_documents(tmp_path / "store")
    assert got == want, first_difference(want, got)
    counts = m["parts"][0]["counts"]
    # (the records of a damaged file skipped before its damage are counted, or not: the docs do not say)
    for reason in set(counts["skipped"]) | set(skipped):
        low = skipped.get(reason, 0)
        assert low <= counts["skipped"].get(reason, 0) <= low + partial.get(reason, 0), \
            f"{reason}: {counts['skipped']} skipped, the docs say {skipped} (+ up to {partial} in damaged files)"
    assert sorted(counts["damaged_files"]) == sorted(damaged), "damaged files named otherwise"
    assert m["totals"]["tokens"] == sum(map(len, want.values()))
    assert all(t[-1] == EOS for t in got.values())


def store_bytes(root: Path):
    """Every file of every part, and the manifest less its times."""
    m = store.read_manifest(root)
    files = {(p["dir"], f.name): f.read_bytes() for p in m["parts"] for f in sorted((root / p["dir"]).iterdir())}
    return files, {**m, "parts": [{k: v for k, v in p.items() if k not in ("created", "stages")} for p in m["parts"]]}


def test_listing_order_workers_and_shards_do_not_change_the_store(tmp_path, monkeypatch):
    rng = random.Random(117117)
    make_corpus(rng, tmp_path / "in", tmp_path / "outside", files=18)
    build([tmp_path / "in"], tmp_path / "one", dedup="exact")
    want = store_bytes(tmp_path / "one")
    real_scandir, real_listdir = os.scandir, os.listdir

    class Reversed:  # (os.scandir's entries, last first: another filesystem's order)
        def __init__(self, *a):
            with real_scandir(*a) as it:
                self.entries = list(it)[::-1]

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

        def __iter__(self):
            return self

        def __next__(self):
            if not self.entries:
                raise StopIteration
            return self.entries.pop(0)

        def close(self):
            pass

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", Reversed)
        m.setattr(os, "listdir", lambda *a: list(reversed(real_listdir(*a))))
        build([tmp_path / "in"], tmp_path / "reversed", dedup="exact")
    assert store_bytes(tmp_path / "reversed") == want, "another listing order built another store"
    monkeypatch.setattr(scan, "SHARD_BYTES", 300)  # (several shards, scanned by two worker processes)
    build([tmp_path / "in"], tmp_path / "workers", dedup="exact", workers=2)
    assert store_bytes(tmp_path / "workers") == want, "other workers built another store"


@pytest.mark.parametrize("case", range(4))
def test_documents_read_across_chunk_boundaries(tmp_path, monkeypatch, case):
    """Lines and characters cut between the chunks a stream is read in (a few bytes each here) come out whole."""
    rng = random.Random(117200 + case)
    monkeypatch.setattr(readers, "CHUNK", rng.choice([1, 2, 3, 5, 64]))
    corrupt = make_corpus(rng, tmp_path / "in", tmp_path / "outside", files=10)
    docs, _, damaged, _ = read_corpus(str(tmp_path / "in"), corrupt)
    if kept(docs, "none"):
        m = build([tmp_path / "in"], tmp_path / "store")
        assert stored_documents(tmp_path / "store") == kept(docs, "none")
        assert sorted(m["parts"][0]["counts"]["damaged_files"]) == sorted(damaged)


def test_a_line_longer_than_a_read_chunk(tmp_path):
    """One JSON line and one text file of ~1.5 MB each, past the 1 MiB a stream is read at a time."""
    rng = random.Random(117300)
    long = "".join(rng.choice(["é", "e\u0301", "😀", "a b", "\r\n", "\u2028", "中"]) for _ in range(600_000))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "short"}\n' + json.dumps({"text": long}).encode() + b"\n")
    (tmp_path / "in" / "b.txt.gz").write_bytes(__import__("gzip").compress(("\ufeff" + long).encode()))
    docs, _, _, _ = read_corpus(str(tmp_path / "in"))
    assert len(docs) == 3 and len(docs[1][1].encode()) > readers.CHUNK
    build([tmp_path / "in"], tmp_path / "store", seq_len=1 << 16)
    assert stored_documents(tmp_path / "store") == kept(docs, "none")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-le"])
def test_a_jsonl_file_not_in_utf8_gives_no_document(tmp_path, encoding):
    """json.loads takes UTF-16 and UTF-32 bytes: such a file gave its first record as a document, the rest counted
    as bad JSON (its lines split at b"\\n" are misaligned). Not UTF-8, it gives none (docs/data.md), skipped whole as
    one file in UTF-16 or UTF-32 (test_leftovers118: no longer one bad line per line); a UTF-8 BOM before a line, at
    the start or where files were concatenated, is still read past."""
    path = tmp_path / "x.jsonl"
    path.write_bytes("".join(json.dumps({"text": t}) + "\n" for t in ["first", "second", "third"]).encode(encoding))
    skipped = Counter()
    assert [d.text for d in readers.iter_file(path, "x.jsonl", "text", skipped)] == []
    assert skipped == Counter({f"utf{encoding[4:6]}_file": 1}), skipped
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\r\n')
    assert [d.text for d in readers.iter_file(path, "x.jsonl", "text", Counter())] == ["a", "b"]


def malformed_inputs(d: Path):
    """(what, the inputs, a piece of text the error must hold) for inputs that cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    cases = []
    for what, table in [("int column", pa.table({"text": [1, 2]})), ("no column", pa.table({"body": ["x"]})),
                        ("two columns", pa.table([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])),
                        ("list column", pa.table({"text": [["a"], ["b"]]}))]:
        sub = d / what.replace(" ", "_")
        sub.mkdir()
        (sub / "a.txt").write_text("a document before it")
        pq.write_table(table, sub / "z.parquet")
        cases.append((what, [sub], str(sub / "z.parquet")))
    (d / "glob").mkdir()
    (d / "glob" / "a.txt").write_text("x")
    cases.append(("glob", [f"{d / 'glob'}/*.txt"], "*.txt"))
    (d / "dangling").mkdir()
    (d / "dangling" / "a.txt").write_text("x")
    (d / "dangling" / "b.txt").symlink_to(d / "nowhere.txt")
    cases.append(("dangling link", [d / "dangling"], str(d / "dangling" / "b.txt")))
    (d / "fields").mkdir()
    (d / "fields" / "r.jsonl").write_text('{"body": "x"}\n{"text": null}\n')
    cases.append(("no record with the text field", [d / "fields"], "no text field"))
    return cases


def test_inputs_that_cannot_be_read_are_refused_naming_them(tmp_path):
    for what, inputs, named in malformed_inputs(tmp_path):
        with pytest.raises(DataError) as e:
            build(inputs, tmp_path / f"store_{what}")
        assert named in str(e.value), f"{what}: {e.value}"
        assert not (tmp_path / f"store_{what}" / store.MANIFEST).exists()
