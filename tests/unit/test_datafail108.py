"""`longctx data build` under failures (audit datafail108): a scan worker killed outright (the out-of-memory
killer) is an error naming the files it read, not a hang, and a rerun resumes to the uninterrupted store; a
failing worker stops the others; a full disk is a DataError naming the directory, its free space and the
space the build needs; dedup keeps the same first documents with one worker or several; a store whose index
files were changed after the build is refused when read; an --out holding another store is refused.

References: an uninterrupted build's part files, and the documents written here (test_data_build_failures)."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_build_failures import FullDisk, by_hand, corpus, not_a_store, opts, part_files, quiet, stored

from longctx.data import store
from longctx.data.builder import readers, scan, scan_pool
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.errors import DataError

SRC = Path(__file__).resolve().parents[2] / "src"
UNIT = Path(__file__).resolve().parent


def forked_workers(monkeypatch):
    """Scan workers forked from this process, so that a patched scan_shard reaches them (spawned ones import
    the module afresh)."""
    import multiprocessing as mp
    monkeypatch.setattr(scan_pool, "worker_context", lambda: mp.get_context("fork"))


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(scan, "SHARD_BYTES", 3000)  # one or two files per shard


# -- a scan worker killed outright -----------------------------------------------------------------------

KILLED_BUILD = """
import multiprocessing as mp, os, signal, sys
sys.path.insert(0, {unit!r})
from test_data_build_failures import opts
from longctx.data.builder import readers, scan, scan_pool
from longctx.data.builder.pipeline import build_store
from longctx.errors import DataError
scan.SHARD_BYTES = 3000
scan_pool.worker_context = lambda: mp.get_context("fork")
real = scan.scan_shard
def killed(work, index, *a, **k):
    if index == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # (as the out-of-memory killer ends a worker)
    return real(work, index, *a, **k)
scan.scan_shard = killed
try:
    build_store(opts([{inputs!r}], {out!r}, workers=2), log=lambda *a: None)
except DataError as e:
    print("DataError:", e)
"""


def test_a_scan_worker_killed_outright_is_an_error_naming_its_files_and_a_rerun_resumes(tmp_path, small_shards):
    texts = corpus(tmp_path / "in", seed=3, files=8)
    build_store(opts([tmp_path / "in"], tmp_path / "whole", workers=2), log=quiet)
    out = tmp_path / "s"
    script = KILLED_BUILD.format(unit=str(UNIT), inputs=str(tmp_path / "in"), out=str(out))
    # (in a process of its own, in a session of its own: before, the build waited forever for the killed
    # worker's shard, and its process group is ended here)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        said, _ = child.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail("the build hung after a scan worker was killed")
    assert "DataError: a scan worker process died" in said, said
    assert "f02.jsonl" in said and "run the same command again to resume" in said, said  # (shard 2: f02.jsonl)
    not_a_store(out)
    shards = out / ".build" / scan.SHARDS
    assert [d.name for d in shards.iterdir() if not d.name.startswith(".")]  # the shards done before are kept
    # run again, unpatched: it resumes, and nothing the killed build left is read as a part or stays
    build_store(opts([tmp_path / "in"], out, workers=2), log=quiet)
    assert part_files(out) == part_files(tmp_path / "whole")
    assert stored(out) == by_hand(texts)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "part-00000"]
    assert store.read_manifest(out)["totals"] == store.read_manifest(tmp_path / "whole")["totals"]


def test_a_failing_scan_worker_is_raised_once_and_stops_the_others_at_once(tmp_path, small_shards, monkeypatch):
    corpus(tmp_path / "in", seed=4, files=8)
    forked_workers(monkeypatch)
    real = scan.scan_shard

    def failing(work, index, *a, **k):
        if index == 1:
            time.sleep(0.5)  # (after shard 0's worker has started its long shard)
            raise RuntimeError("shard 1 could not be scanned")
        if index == 0:
            time.sleep(120)  # a long shard, still running when shard 1 fails
        return real(work, index, *a, **k)

    monkeypatch.setattr(scan, "scan_shard", failing)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="shard 1 could not be scanned"):
        build_store(opts([tmp_path / "in"], tmp_path / "s", workers=2), log=quiet)
    assert time.monotonic() - start < 60  # the worker of shard 0 was stopped, not waited for
    not_a_store(tmp_path / "s")


# -- a full disk ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.2, 0.97])  # in the scan, in the part's files
def test_a_full_disk_names_the_directory_the_space_free_and_the_space_needed(tmp_path, monkeypatch, small_shards,
                                                                           fraction):
    corpus(tmp_path / "in", seed=5, files=8, per_file=10)
    with monkeypatch.context() as mp:
        probe = FullDisk(mp, tmp_path / "whole")
        build_store(opts([tmp_path / "in"], tmp_path / "whole", eval_fraction=0.3), log=quiet)
    out = tmp_path / "s"
    with monkeypatch.context() as mp, pytest.raises(DataError) as e:
        FullDisk(mp, out, int(probe.written * fraction))
        build_store(opts([tmp_path / "in"], out, eval_fraction=0.3), log=quiet)
    said = str(e.value)
    assert f"the disk holding '{out}' is full" in said and "No space left on device" in said, said
    assert re.search(r"MiB is free there now", said) and "Nothing was published" in said, said
    need = float(re.search(r"needs about ([\d,.]+) MiB", said).group(1).replace(",", "")) * 2**20
    assert 0.7 * probe.written <= need <= 1.5 * probe.written, (need, probe.written)  # what the build wrote
    assert e.value.__cause__.errno == errno.ENOSPC
    not_a_store(out)
    build_store(opts([tmp_path / "in"], out, eval_fraction=0.3), log=quiet)  # space freed: it completes
    assert part_files(out) == part_files(tmp_path / "whole")


def test_a_full_disk_in_a_scan_worker_is_the_same_error(tmp_path, monkeypatch, small_shards):
    corpus(tmp_path / "in", seed=6, files=8)
    forked_workers(monkeypatch)
    real = scan.scan_shard

    def full(work, index, *a, **k):
        if index == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(work, index, *a, **k)

    monkeypatch.setattr(scan, "scan_shard", full)
    with pytest.raises(DataError, match=r"the disk holding .* is full.*needs about [\d.,]+ MiB"):
        build_store(opts([tmp_path / "in"], tmp_path / "s", workers=2), log=quiet)
    not_a_store(tmp_path / "s")


# -- dedup with one worker or several -----------------------------------------------------------------------

def test_dedup_keeps_the_first_copy_in_input_order_whatever_the_workers(tmp_path, small_shards):
    rng = np.random.default_rng(7)
    words = [f"w{i}" for i in range(400)]
    base = [" ".join(rng.choice(words, 120)) for _ in range(12)]
    near = [t.replace(t.split()[60], "CHANGED", 1) for t in base]  # one word of 120 changed: a near copy
    root = tmp_path / "in"
    root.mkdir()
    # a copy in a later file (another shard) and in the same file; the first occurrence is the original
    files = [[("orig", i, base[i]) for i in range(6)], [("orig", i, base[i]) for i in range(6, 12)],
             [("exact", i, base[i]) for i in range(0, 12, 2)] + [("near", i, near[i]) for i in range(1, 12, 2)],
             [("near", i, near[i]) for i in range(0, 12, 2)] + [("exact", i, base[i]) for i in range(1, 12, 2)]]
    for f, rows in enumerate(files):
        (root / f"f{f}.jsonl").write_text("".join(json.dumps({"text": t, "id": f"{kind}{i}"}) + "\n"
                                                  for kind, i, t in rows))
    parts = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        build_store(opts([root], out, workers=workers, dedup="minhash", eval_fraction=0.0), log=quiet)
        m = store.read_manifest(out)
        assert m["parts"][0]["counts"]["exact_duplicates"] == 12 and m["parts"][0]["counts"]["near_duplicates"] == 12
        names = [json.loads(line)["name"] for line in (out / "part-00000" / "docs.jsonl").read_text().splitlines()]
        assert names == [f"f{f}.jsonl:{i + 1}" for f in (0, 1) for i in range(6)]  # the originals, in order
        parts[workers] = part_files(out)
    assert parts[1] == parts[2] == parts[3]


# -- a store changed after its build ------------------------------------------------------------------------

def _flip(path: Path, at: int, column: int | None = None) -> None:
    """Change one value of an .npy array in place (its row `at`, `column`), as bit rot or a hand would."""
    a = np.load(path, mmap_mode="r+")
    if column is None:
        a[at] = a[at] + 7
    else:
        a[at, column] = a[at, column] + 1
    a.flush()
    del a


@pytest.mark.parametrize("change", ["pointer", "segment_doc", "segment_start", "part_deleted", "tokens_cut"])
def test_a_store_whose_files_changed_after_the_build_is_refused_when_read(tmp_path, change):
    corpus(tmp_path / "in", seed=8, files=4, per_file=10)
    out = tmp_path / "s"
    build_store(opts([tmp_path / "in"], out), log=quiet)
    part = out / "part-00000"
    if change == "pointer":
        _flip(part / "train.samples.npy", 3)  # a sample index that goes back: a traceback before
    elif change == "segment_doc":
        _flip(part / "train.segments.npy", 5, store.S_DOC)  # another document's spans and mask, silently before
    elif change == "segment_start":
        _flip(part / "train.segments.npy", 5, store.S_START)
    elif change == "part_deleted":
        import shutil
        shutil.rmtree(part)
    else:
        f = part / "train.tokens.npy"
        os.truncate(f, f.stat().st_size - 128)
    with pytest.raises(DataError, match=f"the store '{out}' is damaged.*rebuild it"):
        samples = PackedSamples(out)
        for i in range(len(samples)):
            samples.sample(i)


def test_an_unchanged_store_still_reads(tmp_path):
    corpus(tmp_path / "in", seed=9, files=3)
    build_store(opts([tmp_path / "in"], tmp_path / "s", eval_fraction=0.3), log=quiet)
    for split in store.SPLITS:
        assert len(PackedSamples(tmp_path / "s", split)) > 0


# -- an --out that already holds a store --------------------------------------------------------------------

def test_an_out_holding_another_store_is_refused_and_left_as_it_was(tmp_path):
    corpus(tmp_path / "a", seed=10, files=3)
    corpus(tmp_path / "b", seed=11, files=3)
    out = tmp_path / "s"
    build_store(opts([tmp_path / "a"], out), log=quiet)
    before = part_files(out), (out / store.MANIFEST).read_bytes()
    with pytest.raises(DataError, match=f"'{out}' already holds a data store; pass --append .* or choose another"):
        build_store(opts([tmp_path / "b"], out), log=quiet)
    assert (part_files(out), (out / store.MANIFEST).read_bytes()) == before
    docs = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    assert "already holds a store is refused without `--append`" in " ".join(docs.split())


# -- an input file that cannot be read to its end -----------------------------------------------------------

def test_an_input_file_unreadable_part_way_keeps_none_of_its_documents_and_is_named(tmp_path, monkeypatch):
    texts = corpus(tmp_path / "in", seed=12, files=3, per_file=8)
    real = readers._raw_chunks

    def failing_disk(f):
        if not str(f.name).endswith("f01.jsonl"):
            yield from real(f)
            return
        data = f.read()
        yield data[:len(data) // 2]  # half its lines, then the disk fails
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(readers, "_raw_chunks", failing_disk)
    said = []
    build_store(opts([tmp_path / "in"], tmp_path / "s"), log=lambda *a: said.append(" ".join(map(str, a))))
    counts = store.read_manifest(tmp_path / "s")["parts"][0]["counts"]
    assert counts["damaged_files"] == ["f01.jsonl"] and counts["skipped"] == {"unreadable": 1}
    assert any("f01.jsonl" in line and "unreadable" in line for line in said), said
    assert stored(tmp_path / "s") == by_hand(texts[:8] + texts[16:])  # (before: its first half was kept, unnamed)


# -- the build's own process killed outright ------------------------------------------------------------------

SIGKILLED_BUILD = """
import os, signal, sys
sys.path.insert(0, {unit!r})
from test_data_build_failures import opts
from longctx.data.builder import part_writer, scan, spill
from longctx.data.builder.pipeline import build_store
scan.SHARD_BYTES = 3000
owner, name, k = {{"scan": (spill.RaggedWriter, "append", 40), "pack": (part_writer.SplitWriter, "write", 2),
                   "doc_files": (spill.NpyAppender, "close", 5)}}[{where!r}]
real, calls = getattr(owner, name), []
def killed(*a, **kw):
    calls.append(1)
    if len(calls) == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **kw)
setattr(owner, name, killed)
build_store(opts([{inputs!r}], {out!r}, eval_fraction=0.3), log=lambda *a: None)
"""


@pytest.mark.parametrize("where", ["scan", "pack", "doc_files"])
def test_a_build_sigkilled_part_way_reruns_to_the_uninterrupted_store_with_nothing_left_over(tmp_path, small_shards,
                                                                                            where):
    texts = corpus(tmp_path / "in", seed=13, files=6)
    build_store(opts([tmp_path / "in"], tmp_path / "whole", eval_fraction=0.3), log=quiet)
    out = tmp_path / "s"
    script = SIGKILLED_BUILD.format(unit=str(UNIT), where=where, inputs=str(tmp_path / "in"), out=str(out))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert done.returncode == -signal.SIGKILL, done.stderr
    not_a_store(out)
    assert any(p.name.startswith((".tmp-", ".build")) for p in out.iterdir())  # (it died with work in flight)
    build_store(opts([tmp_path / "in"], out, eval_fraction=0.3), log=quiet)
    assert part_files(out) == part_files(tmp_path / "whole") and stored(out) == by_hand(texts)
    assert store.read_manifest(out)["totals"] == store.read_manifest(tmp_path / "whole")["totals"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "part-00000"]
