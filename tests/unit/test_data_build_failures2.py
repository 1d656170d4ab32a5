"""The offline data build under failures, continued from test_data_build_failures.py (whose helpers it
imports): the default store's cache (a build interrupted or killed outright is never reused, nor a store
of other options or another version) and damaged or empty inputs (damaged or empty compressed files, a
truncated parquet, a cut jsonl, no usable document, an --out that is a file).

Each is checked against an independent reference: the documents written here, tokenized by hand (the
byte tokenizer: UTF-8 bytes and EOS 257)."""

import gzip
import json
import os
import random

import pytest
import zstandard
from test_data_build import text_doc
from test_data_build_audit import quiet
from test_data_build_failures import all_samples, by_hand, corpus, dies_on_call, not_a_store, opts, stored

from longctx.data import store
from longctx.data.builder import readers
from longctx.data.builder.inputs import read_inputs
from longctx.data.builder.part_writer import SplitWriter
from longctx.data.builder.pipeline import build_store
from longctx.errors import DataError

# -- the default store's cache ------------------------------------------------------------------------

def test_an_interrupted_default_store_build_is_never_reused(tmp_path, monkeypatch):
    from longctx.config.schema import DataConfig
    from longctx.data import default_store

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    texts = corpus(tmp_path / "corpus", seed=10, files=3)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), tokenizer="byte", strategy="concat", dedup="exact",
                     eval_fraction=0.0)
    for owner, name in ((SplitWriter, "write"), (store, "write_manifest"), (default_store.os, "rename")):
        with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
            dies_on_call(mp, owner, name, 1)
            default_store.default_store(cfg, 64, log=quiet)
        assert list((tmp_path / "cache" / "data").iterdir()) == []  # nothing left, nothing to reuse
    lines = []
    path = default_store.default_store(cfg, 64, log=lines.append)
    assert any("building the store" in line for line in lines)
    assert stored(path) == by_hand(texts)


def test_a_default_store_build_killed_outright_leaves_nothing_after_the_next_build(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer) runs no `finally`: the half-written store stayed in the cache for good. The
    next build on the host removes it once its process is gone; a live build's, and another host's (a cache
    shared by hosts), stay."""
    import socket
    import subprocess
    import sys

    from longctx.config.schema import DataConfig
    from longctx.data import default_store

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    corpus(tmp_path / "corpus", seed=12, files=2)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), tokenizer="byte", strategy="concat", dedup="exact",
                     eval_fraction=0.0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, cache = socket.gethostname(), tmp_path / "cache" / "data"
    killed = cache / f".tmp-stdlib-64-concat-0123@{host}-{int(dead.stdout)}"
    live = cache / f".tmp-stdlib-64-concat-4567@{host}-{os.getpid()}"
    other_host = cache / f".tmp-stdlib-64-concat-89ab@x{host}-{int(dead.stdout)}"
    for d in (killed, live, other_host):
        (d / "parts").mkdir(parents=True)
        (d / "parts" / "train.00000.bin").write_bytes(b"\0" * 1024)
    path = default_store.default_store(cfg, 64, log=quiet)
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, live.name, other_host.name])


def test_a_cached_default_store_of_other_options_or_another_version_is_not_reused(tmp_path, monkeypatch):
    from dataclasses import replace

    from longctx.config.schema import DataConfig
    from longctx.data import default_store

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    corpus(tmp_path / "corpus", seed=11, files=2)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), tokenizer="byte", strategy="concat", dedup="exact",
                     eval_fraction=0.0)
    first = default_store.default_store(cfg, 64, log=quiet)
    seen = {first}
    for other in (replace(cfg, strategy="bfd"), replace(cfg, dedup="none"), replace(cfg, max_docs=3),
                  replace(cfg, eval_fraction=0.5)):
        path = default_store.default_store(other, 64, log=quiet)
        assert path not in seen
        seen.add(path)
    assert default_store.default_store(cfg, 96, log=quiet) not in seen
    monkeypatch.setattr(default_store, "CACHE_VERSION", default_store.CACHE_VERSION + 1)
    assert default_store.default_store(cfg, 64, log=quiet) not in seen
    # a longctx whose store format is another: it refuses the cached store, so it must not be handed it
    monkeypatch.setattr(store, "VERSION", store.VERSION + 1)
    path = default_store.default_store(cfg, 64, log=quiet)
    assert path not in seen and all_samples(path)


# -- inputs -------------------------------------------------------------------------------------------

def jsonl_bytes(texts):
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)


def test_a_damaged_compressed_jsonl_keeps_none_of_its_lines_and_is_named(tmp_path, monkeypatch):
    """gzip and zstd find damage only at a block's or frame's checksum: the lines decompressed before
    it came out wrong, so a damaged file gives no document (before: every line before the damage was kept)."""
    monkeypatch.setattr(readers, "CHUNK", 4096)  # (as 1 MiB chunks do for files of megabytes)
    rng = random.Random(12)
    good = [f"good {i} " + text_doc(rng, 30) for i in range(5)]
    big = [f"big {i} " + " ".join(str(rng.randrange(10**6)) for _ in range(30)) for i in range(2000)]  # ~460 KB
    d = tmp_path / "in"
    d.mkdir()
    (d / "a_good.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(good)))
    flipped = bytearray(gzip.compress(jsonl_bytes(big), mtime=0))
    flipped[len(flipped) // 10] ^= 0x10  # early: megabytes come out before gzip's checksum says so
    (d / "b_flipped.jsonl.gz").write_bytes(bytes(flipped))
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    z = bytearray(cctx.compress(jsonl_bytes(big)))
    z[len(z) // 10] ^= 0x10
    (d / "c_flipped.jsonl.zst").write_bytes(bytes(z))
    (d / "d_truncated.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(big))[:-5000])
    (d / "e_truncated.jsonl.zst").write_bytes(cctx.compress(jsonl_bytes(big))[:-5000])
    after = [f"after {i} " + text_doc(rng, 30) for i in range(3)]  # read after the damaged ones, same shard
    (d / "f_good.jsonl.zst").write_bytes(cctx.compress(jsonl_bytes(after)))
    good += after
    res = read_inputs([str(d)])
    assert [x.text for x in res.docs] == good
    assert res.skipped["bad_compressed_file"] == 4
    assert res.damaged == ["b_flipped.jsonl.gz", "c_flipped.jsonl.zst", "d_truncated.jsonl.gz",
                           "e_truncated.jsonl.zst"]
    lines = []
    m = build_store(opts([d], tmp_path / "s", dedup="none"), log=lines.append)
    assert stored(tmp_path / "s") == by_hand(good)
    assert m["parts"][0]["counts"]["damaged_files"] == res.damaged
    assert any("b_flipped.jsonl.gz" in line and "e_truncated.jsonl.zst" in line for line in lines)


def test_an_empty_compressed_file_is_a_counted_damaged_file_not_nothing(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for name in ("a.jsonl.gz", "b.jsonl.zst", "c.txt.gz", "d.md.zst"):
        (d / name).write_bytes(b"")  # a download cut before its first byte: no gzip / zstd stream
    (d / "e.jsonl.gz").write_bytes(gzip.compress(b""))  # a real, empty stream: nothing in it, nothing wrong
    (d / "f.txt").write_text("the only document\n")
    res = read_inputs([str(d)])
    assert [x.name for x in res.docs] == ["f.txt"]
    assert res.skipped["bad_compressed_file"] == 4 and res.damaged == ["a.jsonl.gz", "b.jsonl.zst", "c.txt.gz",
                                                                        "d.md.zst"]


def test_a_truncated_parquet_is_a_named_damaged_file_and_a_cut_plain_jsonl_keeps_its_whole_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(22)
    texts = [f"doc {i} " + text_doc(rng, 20) for i in range(12)]
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"text": texts[:6]}), d / "a.parquet", row_group_size=2)
    (d / "a.parquet").write_bytes((d / "a.parquet").read_bytes()[:-30])  # its footer cut off
    plain = jsonl_bytes(texts[6:])
    (d / "b.jsonl").write_bytes(plain[:-25])  # cut inside the last line: that line alone is lost, and counted
    res = read_inputs([str(d)])
    assert [x.text for x in res.docs] == texts[6:11]
    assert dict(res.skipped) == {"other_suffix": 0, "bad_parquet_file": 1, "bad_json_line": 1}
    assert res.damaged == ["a.parquet"]
    m = build_store(opts([d], tmp_path / "s"), log=quiet)
    assert stored(tmp_path / "s") == by_hand(texts[6:11]) and m["parts"][0]["counts"]["damaged_files"] == ["a.parquet"]


def test_empty_inputs_are_a_clear_error_and_leave_no_store(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text("\n\n")
    (d / "b.txt").write_text("   \n")
    with pytest.raises(DataError, match="hold no usable document"):
        build_store(opts([d], tmp_path / "s"), log=quiet)
    not_a_store(tmp_path / "s")


def test_an_out_that_is_a_file_is_refused_and_left_as_it_was(tmp_path):
    corpus(tmp_path / "in", seed=3, files=1)
    out = tmp_path / "s"
    out.write_text("not a store")
    with pytest.raises(DataError, match="exists and is not a directory"):
        build_store(opts([tmp_path / "in"], out), log=quiet)
    assert out.read_text() == "not a store"
