"""The offline data build under failures and resumes: a build killed part-way (an exception or a
KeyboardInterrupt inside a shard's scan, the packing, between a part's rename and the manifest), a
full disk (ENOSPC at every point of a build and of an append), two builds into one directory, the
default store's cache, and damaged or empty inputs.

Each is checked against an independent reference: the part files of a build that was never
interrupted, and the documents written here, tokenized by hand (the byte tokenizer: UTF-8 bytes and
EOS 257)."""

import builtins
import errno
import gzip
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import zstandard
from test_data_build import store_documents, text_doc
from test_data_build_audit import opts as audit_opts
from test_data_build_audit import quiet

from longctx.data import store
from longctx.data.builder import pipeline, readers, scan, spill
from longctx.data.builder.inputs import read_inputs
from longctx.data.builder.part_writer import SplitWriter
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.loader import PackedSamples
from longctx.data.store import read_manifest
from longctx.errors import DataError

EOS = 257


def opts(inputs, out, **kw):
    """test_data_build_audit's build options, in 128-token samples with exact dedup."""
    return audit_opts(inputs, out, **{"seq_len": 128, "dedup": "exact", **kw})


def corpus(root, seed=0, files=6, per_file=5):
    """jsonl files of distinct documents; their texts in input order (the reference)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for f in range(files):
        mine = [f"[{seed}.{f}.{i}] " + text_doc(rng, rng.randint(20, 90)) for i in range(per_file)]
        (root / f"f{f:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in mine))
        texts += mine
    return texts


def by_hand(texts):
    return sorted(list(t.encode()) + [EOS] for t in texts)


def stored(root):
    """The store's documents (each tiled from its pieces), sorted; checks the manifest's totals too."""
    got = sorted(store_documents(root).values())
    assert read_manifest(root)["totals"]["tokens"] == sum(map(len, got))
    return got


def part_files(root):
    m = read_manifest(root)
    return {(p["dir"], f.name): f.read_bytes() for p in m["parts"] for f in sorted((root / p["dir"]).iterdir())}


def all_samples(root):
    loaded = PackedSamples(root)
    return [loaded.sample(i)[0].tolist() for i in range(len(loaded))]


def not_a_store(root):
    assert not (root / store.MANIFEST).exists()
    with pytest.raises(DataError, match="not a longctx data store"):
        PackedSamples(root)


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(scan, "SHARD_BYTES", 3000)  # one or two files per shard


def dies_on_call(mp, owner, name, k, exc=KeyboardInterrupt):
    """`owner.name` raises `exc` on its k-th call (counted over the whole build), patched with `mp`."""
    real, calls = getattr(owner, name), []

    def wrapper(*a, **kw):
        calls.append(1)
        if len(calls) == k:
            raise exc
        return real(*a, **kw)

    mp.setattr(owner, name, wrapper)
    return calls


# -- a build killed part-way, then run again --------------------------------------------------------

@pytest.mark.parametrize("k", [3, 40, 95])  # in the first shard, in the middle, in the last one
def test_a_build_killed_inside_a_shards_scan_resumes_to_the_uninterrupted_store(tmp_path, small_shards, monkeypatch,
                                                                                k):
    texts = corpus(tmp_path / "in")
    build_store(opts([tmp_path / "in"], tmp_path / "whole"), log=quiet)
    assert stored(tmp_path / "whole") == by_hand(texts)
    # six ragged files per document: the k-th append is inside document ~k/6, part of its shard written
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, spill.RaggedWriter, "append", k)
        build_store(opts([tmp_path / "in"], tmp_path / "s"), log=quiet)
    not_a_store(tmp_path / "s")
    shards = tmp_path / "s" / pipeline.WORK / scan.SHARDS
    assert all((d / "shard.json").is_file() for d in shards.iterdir() if not d.name.startswith("."))
    build_store(opts([tmp_path / "in"], tmp_path / "s"), log=quiet)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "whole")
    assert stored(tmp_path / "s") == by_hand(texts)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["manifest.json", "part-00000"]


@pytest.mark.parametrize("where", ["pack", "doc_files", "manifest"])
def test_a_build_killed_after_the_scan_reruns_to_the_uninterrupted_store(tmp_path, monkeypatch, where):
    texts = corpus(tmp_path / "in", seed=1)
    build_store(opts([tmp_path / "in"], tmp_path / "whole", eval_fraction=0.3), log=quiet)
    owner, name = {"pack": (SplitWriter, "write"), "doc_files": (spill.NpyAppender, "close"),
                   "manifest": (store, "write_manifest")}[where]
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, owner, name, {"pack": 2, "doc_files": 5, "manifest": 1}[where])
        build_store(opts([tmp_path / "in"], tmp_path / "s", eval_fraction=0.3), log=quiet)
    not_a_store(tmp_path / "s")  # (after "manifest" the part is renamed into place but listed nowhere)
    build_store(opts([tmp_path / "in"], tmp_path / "s", eval_fraction=0.3), log=quiet)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "whole")
    assert stored(tmp_path / "s") == by_hand(texts)


def test_an_interrupted_build_then_a_build_of_other_inputs_holds_only_the_second(tmp_path, monkeypatch):
    first = corpus(tmp_path / "a", seed=2)
    second = corpus(tmp_path / "b", seed=3, files=3)
    build_store(opts([tmp_path / "b"], tmp_path / "ref", seq_len=64), log=quiet)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, store, "write_manifest", 1)  # part-00000 of the first is published
        build_store(opts([tmp_path / "a"], tmp_path / "s"), log=quiet)
    assert (tmp_path / "s" / "part-00000").is_dir()
    lines = []
    build_store(opts([tmp_path / "b"], tmp_path / "s", seq_len=64), log=lines.append)  # other inputs and seq_len
    assert stored(tmp_path / "s") == by_hand(second) and not set(map(tuple, by_hand(first))) & set(
        map(tuple, stored(tmp_path / "s")))
    assert part_files(tmp_path / "s") == part_files(tmp_path / "ref")
    # a complete store is never replaced or mixed by a build without --append
    with pytest.raises(DataError, match="--append"):
        build_store(opts([tmp_path / "a"], tmp_path / "s", seq_len=64), log=quiet)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "ref")


def test_a_shard_scan_killed_part_way_is_refused_by_merge_until_rerun(tmp_path, small_shards, monkeypatch):
    texts = corpus(tmp_path / "in", seed=19)
    kw = {"strategy": "datasculpt", "eval_fraction": 0.2}  # (embeddings: a work directory of its own)
    build_store(opts([tmp_path / "in"], tmp_path / "one", **kw), log=quiet)
    build_store(opts([tmp_path / "in"], tmp_path / "scan0", shard=(0, 2), **kw), log=quiet)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, spill.RaggedWriter, "append", 20)
        build_store(opts([tmp_path / "in"], tmp_path / "scan1", shard=(1, 2), **kw), log=quiet)
    scans = [str(tmp_path / "scan0"), str(tmp_path / "scan1")]
    with pytest.raises(DataError, match="unfinished"):
        merge_scans(scans, str(tmp_path / "merged"), progress=False, log=quiet)
    not_a_store(tmp_path / "merged")
    build_store(opts([tmp_path / "in"], tmp_path / "scan1", shard=(1, 2), **kw), log=quiet)  # resumes
    merge_scans(scans, str(tmp_path / "merged"), progress=False, log=quiet)
    assert part_files(tmp_path / "merged") == part_files(tmp_path / "one")
    assert stored(tmp_path / "merged") == by_hand(texts)
    # nothing of the merge's own work is left behind (its embeddings were, before: bytes per document)
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["manifest.json", "part-00000"]


def test_a_store_inside_its_input_directory_never_reads_its_own_files(tmp_path, monkeypatch):
    """`--input corpus --out corpus/store`: a rerun after a kill read the work directory's plan.json as a
    document (and an append the store's manifest.json: .json is a text suffix)."""
    src = tmp_path / "corpus"
    texts = corpus(src, seed=20, files=3)
    (src / "notes.txt").write_text("a text note\n")
    texts.append("a text note\n")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, spill.NpyAppender, "close", 3)  # the scan is done, its plan.json left in store/.build
        build_store(opts([src], src / "store"), log=quiet)
    build_store(opts([src], src / "store"), log=quiet)
    assert stored(src / "store") == by_hand(texts)
    (src / "more.txt").write_text("one more document\n")
    build_store(opts([src], src / "store", append=True), log=quiet)  # the rest: exact duplicates of part 0
    assert stored(src / "store") == by_hand(texts + ["one more document\n"])


def test_a_build_failing_before_it_writes_leaves_no_empty_out(tmp_path, monkeypatch):
    """A bad input (or any failure before the first file) left the --out it had created, and its parents,
    empty: it looked like a store that lost its files. They are removed; an --out that existed stays, and a
    build that failed after scanning keeps its work (to be resumed)."""
    from longctx.errors import DataError

    with pytest.raises(DataError, match="does not exist"):
        build_store(audit_opts([tmp_path / "missing"], tmp_path / "new" / "deeper" / "store"), log=quiet)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    with pytest.raises(DataError, match="does not exist"):
        build_store(audit_opts([tmp_path / "missing"], tmp_path / "kept"), log=quiet)
    assert (tmp_path / "kept").is_dir()
    corpus(tmp_path / "corpus", seed=13, files=3)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, SplitWriter, "write", 1)
        build_store(audit_opts([tmp_path / "corpus"], tmp_path / "started"), log=quiet)
    assert any((tmp_path / "started").iterdir())


def test_a_second_build_into_a_directory_a_build_is_writing_is_refused_not_mixed(tmp_path, monkeypatch):
    """The second build starts while the first is between publishing its part and writing its manifest
    (run from inside it): unchecked, it deleted the first's part as stale, published its own, and the
    first's manifest then landed over it: the first's counts and names over the second's tokens."""
    first = corpus(tmp_path / "a", seed=14, files=3)
    corpus(tmp_path / "b", seed=15, files=4)
    build_store(opts([tmp_path / "a"], tmp_path / "ref"), log=quiet)
    real, refused = store.write_manifest, []

    def second_build_starts(root, manifest):
        mp.setattr(store, "write_manifest", real)  # (the second build's own manifest: written plainly)
        try:
            build_store(opts([tmp_path / "b"], tmp_path / "s"), log=quiet)
        except DataError as e:
            refused.append(str(e))
        real(root, manifest)

    with monkeypatch.context() as mp:
        mp.setattr(store, "write_manifest", second_build_starts)
        build_store(opts([tmp_path / "a"], tmp_path / "s"), log=quiet)
    assert refused and "another `longctx data build`" in refused[0]
    assert part_files(tmp_path / "s") == part_files(tmp_path / "ref")
    assert stored(tmp_path / "s") == by_hand(first) and len(all_samples(tmp_path / "s")) > 0


def test_a_manifest_over_another_builds_part_is_refused_when_read(tmp_path):
    corpus(tmp_path / "a", seed=16, files=3)
    corpus(tmp_path / "b", seed=17, files=4)
    for name in ("a", "b"):
        build_store(opts([tmp_path / name], tmp_path / f"s_{name}", eval_fraction=0.3), log=quiet)
    assert all_samples(tmp_path / "s_a")
    shutil.rmtree(tmp_path / "s_a" / "part-00000")
    shutil.copytree(tmp_path / "s_b" / "part-00000", tmp_path / "s_a" / "part-00000")
    with pytest.raises(DataError, match="is damaged.*its manifest"):
        PackedSamples(tmp_path / "s_a")
    # a tokens file cut short (its header still says the full shape) is refused too
    shutil.rmtree(tmp_path / "s_a")
    build_store(opts([tmp_path / "a"], tmp_path / "s_a", eval_fraction=0.3), log=quiet)
    f = tmp_path / "s_a" / "part-00000" / "train.tokens.npy"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(DataError, match="is damaged"):
        PackedSamples(tmp_path / "s_a")


@pytest.mark.parametrize("other", [{"seq_len": 64}, {"strategy": "bfd"}, {"eval_fraction": 0.4}, {"dedup": "none"}])
def test_a_killed_build_rerun_with_other_options_equals_a_fresh_build_with_them(tmp_path, monkeypatch, other):
    corpus(tmp_path / "in", seed=21, files=4)
    build_store(opts([tmp_path / "in"], tmp_path / "ref", **other), log=quiet)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, SplitWriter, "write", 1)  # the scan is kept (the packing options do not change it)
        build_store(opts([tmp_path / "in"], tmp_path / "s"), log=quiet)
    build_store(opts([tmp_path / "in"], tmp_path / "s", **other), log=quiet)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "ref")
    assert {k: read_manifest(tmp_path / "s")[k] for k in other} == other


def test_an_append_killed_after_its_part_is_published_leaves_the_store_and_a_later_append_is_clean(tmp_path,
                                                                                                  monkeypatch):
    base, extra, other = (corpus(tmp_path / n, seed=s, files=3) for n, s in (("a", 4), ("b", 5), ("c", 6)))
    build_store(opts([tmp_path / "a"], tmp_path / "s"), log=quiet)
    before = (part_files(tmp_path / "s"), read_manifest(tmp_path / "s"))
    samples = all_samples(tmp_path / "s")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, store, "write_manifest", 1)
        build_store(opts([tmp_path / "b"], tmp_path / "s", append=True), log=quiet)
    assert (tmp_path / "s" / "part-00001").is_dir()  # renamed into place, listed nowhere
    assert (part_files(tmp_path / "s"), read_manifest(tmp_path / "s")) == before
    assert all_samples(tmp_path / "s") == samples
    build_store(opts([tmp_path / "c"], tmp_path / "s", append=True), log=quiet)  # another append
    assert stored(tmp_path / "s") == by_hand(base + other)
    assert sorted(store_documents(tmp_path / "s")) == list(range(len(base + other)))
    del extra


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fsync'ed descriptor through /proc")
def test_a_scanned_shard_is_on_the_disk_before_it_counts_as_done(tmp_path, monkeypatch, small_shards):
    """A resumed build trusts every shard that has its shard.json: after a power loss its files must be
    whole, so they are synced before the rename that publishes the shard."""
    corpus(tmp_path / "in", seed=18, files=3)
    synced, published = set(), []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        if Path(dst).parent.name == scan.SHARDS:
            files = [os.path.realpath(f) for f in Path(src).iterdir()]
            published.append((len(files), [f for f in files if f not in synced]))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    build_store(opts([tmp_path / "in"], tmp_path / "s"), log=quiet)
    assert len(published) >= 3 and all(n >= 10 and unsynced == [] for n, unsynced in published), published


# -- a full disk ---------------------------------------------------------------------------------

class FullDisk:
    """Writes into `root` fail with ENOSPC once `budget` bytes are written there (the write that
    crosses it writes its part first, as a file system does); `written` counts them."""

    def __init__(self, monkeypatch, root, budget=float("inf")):
        self.root, self.budget, self.written = str(root), budget, 0
        real = builtins.open

        def opener(file, mode="r", *a, **k):
            f = real(file, mode, *a, **k)
            if isinstance(file, (str, bytes)) or hasattr(file, "__fspath__"):
                if any(c in mode for c in "wax+") and str(file).startswith(self.root):
                    return _Limited(f, self)
            return f

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)


class _Limited:
    def __init__(self, f, disk):
        self._f, self._disk = f, disk

    def write(self, data):
        room = self._disk.budget - self._disk.written
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        if n > room:
            self._f.write(data[:max(0, int(room))])
            self._disk.written = self._disk.budget
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.written += n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_full_disk_at_any_point_of_a_build_leaves_no_store_and_a_rerun_completes(tmp_path, monkeypatch,
                                                                                    small_shards):
    texts = corpus(tmp_path / "in", seed=7, files=4)
    with monkeypatch.context() as mp:
        probe = FullDisk(mp, tmp_path / "whole")
        build_store(opts([tmp_path / "in"], tmp_path / "whole", eval_fraction=0.3), log=quiet)
    total = probe.written
    assert total > 10_000 and stored(tmp_path / "whole") == by_hand(texts)
    # (the manifest is written last: total - 50 fails inside it)
    budgets = sorted({int(total * f) for f in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97)} | {total - 200, total - 50})
    for i, budget in enumerate(budgets):
        out = tmp_path / f"s{i}"
        with monkeypatch.context() as mp, pytest.raises(DataError, match="is full.*No space") as e:  # budget {budget}
            FullDisk(mp, out, budget)
            build_store(opts([tmp_path / "in"], out, eval_fraction=0.3), log=quiet)
        assert e.value.__cause__.errno == errno.ENOSPC
        not_a_store(out)
        assert not list(out.glob(f".{store.MANIFEST}.tmp-*"))
        build_store(opts([tmp_path / "in"], out, eval_fraction=0.3), log=quiet)  # the disk was freed
        assert part_files(out) == part_files(tmp_path / "whole"), budget


def test_a_full_disk_during_an_append_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    base = corpus(tmp_path / "a", seed=8, files=3)
    more = corpus(tmp_path / "b", seed=9, files=3)
    for root in (tmp_path / "ref", tmp_path / "s"):
        build_store(opts([tmp_path / "a"], root), log=quiet)
    with monkeypatch.context() as mp:
        probe = FullDisk(mp, tmp_path / "ref")
        build_store(opts([tmp_path / "b"], tmp_path / "ref", append=True), log=quiet)
    total = probe.written
    m0, samples = read_manifest(tmp_path / "s"), all_samples(tmp_path / "s")
    for i, budget in enumerate((0, total // 3, total // 2, total - 300, total - 50)):
        root = tmp_path / f"s{i}"
        shutil.copytree(tmp_path / "s", root)  # (each from the start: a rerun resumes the scan, writing less)
        with monkeypatch.context() as mp, pytest.raises(DataError, match="is full.*the store is as it was"):
            FullDisk(mp, root, budget)  # budget {budget}
            build_store(opts([tmp_path / "b"], root, append=True), log=quiet)
        assert read_manifest(root) == m0 and all_samples(root) == samples and stored(root) == by_hand(base)
        build_store(opts([tmp_path / "b"], root, append=True), log=quiet)
        assert part_files(root) == part_files(tmp_path / "ref") and stored(root) == by_hand(base + more)


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


def test_a_document_bigger_than_a_shard_and_many_samples_survives_a_killed_build(tmp_path, small_shards,
                                                                                    monkeypatch):
    rng = random.Random(13)
    texts = corpus(tmp_path / "in", seed=13, files=3)
    huge = text_doc(rng, 3000)  # ~30 KB: ten shards' worth, ~240 samples
    assert len(huge.encode()) > 8 * scan.SHARD_BYTES
    (tmp_path / "in" / "f01.jsonl").write_text(
        (tmp_path / "in" / "f01.jsonl").read_text() + json.dumps({"text": huge}) + "\n")
    texts = texts[:10] + [huge] + texts[10:]
    build_store(opts([tmp_path / "in"], tmp_path / "whole", eval_fraction=0.2), log=quiet)
    assert stored(tmp_path / "whole") == by_hand(texts)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, SplitWriter, "write", 2)
        build_store(opts([tmp_path / "in"], tmp_path / "s", eval_fraction=0.2), log=quiet)
    build_store(opts([tmp_path / "in"], tmp_path / "s", eval_fraction=0.2), log=quiet)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "whole")


def test_an_out_that_is_a_file_is_refused_and_left_as_it_was(tmp_path):
    corpus(tmp_path / "in", seed=3, files=1)
    out = tmp_path / "s"
    out.write_text("not a store")
    with pytest.raises(DataError, match="exists and is not a directory"):
        build_store(opts([tmp_path / "in"], out), log=quiet)
    assert out.read_text() == "not a store"
