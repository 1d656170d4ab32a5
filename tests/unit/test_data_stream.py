"""The streaming build: the documents in-memory dedup keeps, resume after an interruption, shard
scans merged into the store one build gives, an eval split that is never silently empty, and the
memory bound's settings."""

import json
import os
import random

import numpy as np
import pytest
from test_data_build import quiet, store_documents, text_doc

from longctx.data.builder import pipeline, scan
from longctx.data.builder.dedup import deduplicate
from longctx.data.builder.inputs import read_inputs
from longctx.data.builder.options import BuildOptions, parse_memory
from longctx.data.builder.part_writer import groups
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.store import read_manifest
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import DataError


def corpus(root, seed=0, files=8, docs_per_file=6, words=120):
    """jsonl files with exact and near copies planted across files (so across shards)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    made = []
    for f in range(files):
        with open(root / f"f{f:02d}.jsonl", "w") as out:
            for _ in range(docs_per_file):
                u = rng.random()
                if made and u < 0.1:
                    text = rng.choice(made).replace("\n", " \t\n")  # exact copy (trailing whitespace on lines)
                elif made and u < 0.2:
                    words_ = rng.choice(made).split(" ")
                    words_[rng.randrange(len(words_))] = "changed"
                    text = " ".join(words_)  # near copy
                else:
                    text = text_doc(rng, rng.randint(words // 2, words * 3))
                    made.append(text)
                out.write(json.dumps({"text": text}) + "\n")
    return root


def opts(inputs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 1)
    kw.setdefault("seq_len", 256)
    return BuildOptions(inputs=[str(i) for i in inputs], out=str(out), **kw)


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(scan, "SHARD_BYTES", 4096)  # one or two files per shard


def part_files(root):
    d = root / read_manifest(root)["parts"][0]["dir"]
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_streaming_build_keeps_what_in_memory_dedup_keeps(tmp_path, small_shards):
    src = corpus(tmp_path / "in")
    res = read_inputs([str(src)])
    dd = deduplicate([d.text for d in res.docs], "minhash")
    assert dd.exact_duplicates > 0 and dd.near_duplicates > 0  # the corpus plants both
    m = build_store(opts([src], tmp_path / "s", eval_fraction=0.2), log=quiet)
    assert len(scan.plan_shards(scan.plan_units([str(src)])[0])) > 3
    names = [json.loads(x)["name"] for x in (tmp_path / "s/part-00000/docs.jsonl").read_text().splitlines()]
    assert names == [d.name for d, k in zip(res.docs, dd.keep) if k]
    counts = m["parts"][0]["counts"]
    assert (counts["exact_duplicates"], counts["near_duplicates"]) == (dd.exact_duplicates, dd.near_duplicates)
    # every kept document's tokens are in the store exactly once, in order
    tok = ByteTokenizer()
    want = [np.concatenate([tok.encode(d.text), [tok.eos_id]]).tolist() for d, k in zip(res.docs, dd.keep) if k]
    got = store_documents(tmp_path / "s")
    assert [got[i] for i in range(len(want))] == want


def test_an_interrupted_build_resumes_and_equals_an_uninterrupted_one(tmp_path, small_shards, monkeypatch):
    src = corpus(tmp_path / "in", seed=1)
    build_store(opts([src], tmp_path / "whole", eval_fraction=0.1), log=quiet)
    real, calls = scan.scan_shard, []

    def dies_on_the_fourth(*a, **k):
        calls.append(a[1])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(scan, "scan_shard", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        build_store(opts([src], tmp_path / "s", eval_fraction=0.1), log=quiet)
    assert not (tmp_path / "s/manifest.json").exists()
    monkeypatch.setattr(scan, "scan_shard", real)
    redone, lines = [], []
    monkeypatch.setattr(scan, "scan_shard", lambda *a, **k: (redone.append(a[1]), real(*a, **k))[1])
    build_store(opts([src], tmp_path / "s", eval_fraction=0.1), log=lines.append)
    assert any("resuming: 3 of" in line for line in lines)
    assert redone[:3] == [0, 1, 2] and len(set(redone)) == len(redone)  # the three done ones return at once
    assert part_files(tmp_path / "s") == part_files(tmp_path / "whole")
    assert not (tmp_path / "s" / pipeline.WORK).exists()


def test_shard_scans_merge_into_the_store_of_one_build(tmp_path, small_shards):
    src = corpus(tmp_path / "in", seed=2)
    # a copy in the last file of a document of the first: a duplicate across the two machines' shares
    first = json.loads((src / "f00.jsonl").read_text().splitlines()[0])["text"]
    with open(src / "f07.jsonl", "a") as f:
        f.write(json.dumps({"text": first}) + "\n")
    build_store(opts([src], tmp_path / "one", eval_fraction=0.1), log=quiet)
    plans = [build_store(opts([src], tmp_path / f"scan{i}", shard=(i, 2), eval_fraction=0.1), log=quiet)
             for i in range(2)]
    assert plans[0]["range"][1] == plans[1]["range"][0] and plans[0]["range"][0] == 0
    with pytest.raises(DataError, match="missing"):
        merge_scans([str(tmp_path / "scan0")], str(tmp_path / "bad"), progress=False, log=quiet)
    m = merge_scans([str(tmp_path / "scan1"), str(tmp_path / "scan0")], str(tmp_path / "merged"), progress=False,
                    log=quiet)
    assert part_files(tmp_path / "merged") == part_files(tmp_path / "one")
    names = (tmp_path / "merged/part-00000/docs.jsonl").read_text()
    assert "f07.jsonl:7" not in names and "f00.jsonl:1" in names
    assert m["totals"]["duplicates_removed"] >= 1
    with pytest.raises(DataError, match="other inputs or with other options"):
        build_store(opts([src], tmp_path / "scan9", shard=(1, 2), eval_fraction=0.1, seq_len=128), log=quiet)
        merge_scans([str(tmp_path / "scan0"), str(tmp_path / "scan9")], str(tmp_path / "bad2"), progress=False,
                    log=quiet)


def test_eval_split_is_never_silently_empty(tmp_path):
    # three documents, each many samples long: at eval_fraction 0.02 the name hash holds out none of them
    d = tmp_path / "long"
    d.mkdir()
    rng = random.Random(3)
    for i in range(3):
        (d / f"book{i}.txt").write_text(text_doc(rng, 4000))
    m = build_store(opts([d], tmp_path / "s", eval_fraction=0.02), log=quiet)
    assert m["totals"]["eval_samples"] >= 1
    assert m["totals"]["train_samples"] >= 10 * m["totals"]["eval_samples"]
    # one short document: nothing to hold out; said, not silent
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("just one short document\n")
    lines = []
    m = build_store(opts([tmp_path / "one"], tmp_path / "s1", eval_fraction=0.02), log=lines.append)
    assert m["totals"]["eval_samples"] == 0
    assert any("eval split: empty" in line and "--eval-fraction 0" in line for line in lines)


def test_memory_bound_settings_and_errors(tmp_path):
    assert parse_memory("300MB") == 300 << 20 and parse_memory("2GiB") == 2 << 30
    with pytest.raises(DataError, match="300MB or 4GB"):
        parse_memory("lots")
    small, big = BuildOptions([], "x", 256, max_memory=300 << 20, workers=8), BuildOptions([], "x", 256, workers=8)
    assert small.scan_workers < big.scan_workers and small.group_tokens < big.group_tokens
    with pytest.raises(DataError, match="below what a build needs"):
        build_store(opts([tmp_path], tmp_path / "s", max_memory=50 << 20), log=quiet)
    with pytest.raises(DataError, match="--shard and --max-docs"):
        build_store(opts([tmp_path], tmp_path / "s", shard=(0, 2), max_docs=5), log=quiet)


def test_a_cluster_bigger_than_a_group_is_packed_in_runs():
    """The memory bound holds for one huge cluster too: it is cut into runs of about a group each;
    every item lands in exactly one group, in order within its cluster."""
    lengths = np.full(40, 100)
    clusters = np.r_[np.zeros(35, int), np.ones(5, int)]  # one cluster of 3,500 tokens, one of 500
    got = list(groups(np.arange(40), lengths, clusters, 1000))
    assert sorted(np.concatenate(got).tolist()) == list(range(40))
    assert max(int(lengths[g].sum()) for g in got) <= 2 * 1000
    assert len(got) >= 3


def test_a_killed_scans_partial_shards_are_removed_but_not_a_live_ones(tmp_path):
    shards = tmp_path / "shards"
    dead = shards / f".tmp-000001-{2**22 + 12345}"  # above Linux's largest pid: no such process
    live = shards / f".tmp-000002-{os.getpid()}"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "text.bin").write_bytes(b"x")
    scan.remove_stale_partials(shards)
    assert not dead.exists() and live.exists()
