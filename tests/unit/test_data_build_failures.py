"""The offline data build under failures and resumes: a build killed part-way (an exception or a
KeyboardInterrupt inside a shard's scan, the packing, between a part's rename and the manifest), a
full disk (ENOSPC at every point of a build and of an append), two builds into one directory. The
default store's cache and damaged or empty inputs are in test_data_build_failures2.py, which imports
the helpers defined here (as other modules do: test_datafail108.py, test_data_helper_audit.py).

Each is checked against an independent reference: the part files of a build that was never
interrupted, and the documents written here, tokenized by hand (the byte tokenizer: UTF-8 bytes and
EOS 257)."""

import builtins
import errno
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from test_data_build import store_documents, text_doc
from test_data_build_audit import opts as audit_opts
from test_data_build_audit import quiet

from longctx.data import store
from longctx.data.builder import pipeline, scan, spill
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
