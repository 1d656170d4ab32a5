"""Input formats of `longctx data build`: compressed text and jsonl (.gz, .zst), Hugging Face datasets
saved with save_to_disk (arrow), lone arrow files; the streaming per-unit reader under them."""

import builtins
import gzip
import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import zstandard

from longctx.cli import main as longctx_main
from longctx.data.builder import readers
from longctx.data.builder.inputs import input_files, read_inputs, unit_size
from longctx.data.builder.readers import iter_file
from longctx.errors import DataError

JSONL = ('{"text": "first record"}\nnot json\n{"body": "no text field"}\n\n{"text": "caf\\u00e9\\r\\nline"}\n'
         '{"text": ""}\n{"text": "last record"}\n')
TEXTS = {"a.jsonl": JSONL, "notes.txt": "\ufeffsome notes\r\n", "mod.py": "def f():\n    return 1\n"}


def zst(data: bytes, frames: int = 1) -> bytes:
    """zstd data in `frames` frames, as pzstd or concatenated .zst files have them."""
    step = -(-len(data) // frames)
    return b"".join(zstandard.ZstdCompressor().compress(data[i:i + step]) for i in range(0, len(data), step))


def write_tree(d: Path, compress=None, suffix=""):
    d.mkdir()
    for name, text in TEXTS.items():
        raw = text.encode()
        (d / (name + suffix)).write_bytes(compress(raw) if compress else raw)
    return d


def stream_file(path: Path, table: pa.Table, batch_rows: int = 2):
    with ipc.new_stream(path, table.schema) as w:
        for batch in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(batch)


def hand_saved_dataset(d: Path, shards: list[list[str]], extra: dict | None = None):
    """The layout Dataset.save_to_disk writes, written with pyarrow alone."""
    d.mkdir(parents=True)
    files = []
    for i, texts in enumerate(shards):
        name = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        stream_file(d / name, pa.table({"text": texts, "id": list(range(len(texts))), **(extra or {})}))
        files.append({"filename": name})
    (d / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "x", "_split": None}))
    (d / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    return d


def test_compressed_text_and_jsonl_read_like_the_uncompressed(tmp_path):
    plain = read_inputs([str(write_tree(tmp_path / "plain"))])
    assert [d.name for d in plain.docs] == ["a.jsonl:1", "a.jsonl:5", "a.jsonl:7", "mod.py", "notes.txt"]
    for i, (suffix, compress) in enumerate([(".gz", gzip.compress), (".zst", zst), (".zst", lambda b: zst(b, 3))]):
        res = read_inputs([str(write_tree(tmp_path / f"c{i}", compress, suffix))])
        assert [d.text for d in res.docs] == [d.text for d in plain.docs]
        assert [d.name for d in res.docs] == [d.name.replace(".jsonl", ".jsonl" + suffix) if ":" in d.name
                                              else d.name + suffix for d in plain.docs]
        assert res.skipped == plain.skipped and res.files == plain.files and res.bytes == plain.bytes
    # a compressed and an uncompressed copy side by side are different documents
    both = tmp_path / "both"
    both.mkdir()
    (both / "x.jsonl").write_text(JSONL)
    (both / "x.jsonl.gz").write_bytes(gzip.compress(JSONL.encode()))
    names = [d.name for d in read_inputs([str(both)]).docs]
    assert len(names) == len(set(names)) == 6 and "x.jsonl.gz:7" in names
    # a single compressed file given as the input
    assert [d.name for d in read_inputs([str(both / "x.jsonl.gz")]).docs] == ["x.jsonl.gz:1", "x.jsonl.gz:5",
                                                                             "x.jsonl.gz:7"]


def test_suffix_before_the_compression_decides(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "t.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    (d / "t.arrow.zst").write_bytes(zst(b"x"))
    (d / "pic.png.gz").write_bytes(gzip.compress(b"\x89PNG"))
    (d / "archive.tar.gz").write_bytes(gzip.compress(b"x"))
    (d / "readme.md.gz").write_bytes(gzip.compress(b"# hello\n"))
    root, units, skipped = input_files(str(d))
    assert [u.name for u in units] == ["readme.md.gz"] and skipped == 4
    res = read_inputs([str(d)])
    assert [x.name for x in res.docs] == ["readme.md.gz"] and res.skipped["other_suffix"] == 4
    assert input_files(str(d / "t.parquet.gz"))[1:] == ([], 1)


def test_dot_directories_are_not_read(tmp_path):
    """A project directory given as --input: its .git objects, a .venv's installed .py files and a tool's
    cache are not the corpus (they were read: every file but a dotfile itself). An input that is itself
    a dot-directory is read; one holding documents only under dot-directories is a clear error."""
    d = tmp_path / ".proj"
    for rel in ["src/a.py", "docs/b.md", ".venv/lib/site.py", ".git/HEAD.txt", "src/.cache/c.json", ".hid.txt"]:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(f"text of {rel}\n")
    root, units, skipped = input_files(str(d))
    assert [u.relative_to(root).as_posix() for u in units] == ["docs/b.md", "src/a.py"] and skipped == 0
    assert [x.name for x in read_inputs([str(d)]).docs] == ["docs/b.md", "src/a.py"]
    only = tmp_path / "only"
    (only / ".git").mkdir(parents=True)
    (only / ".git" / "x.txt").write_text("x\n")
    with pytest.raises(DataError, match="names starting with '.'"):
        input_files(str(only))


def test_corrupt_compressed_files_are_skipped_and_reading_goes_on(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    good = b"".join(json.dumps({"text": f"record {i}"}).encode() + b"\n" for i in range(200))
    (d / "a_good.jsonl.gz").write_bytes(gzip.compress(good))
    (d / "b_not_gzip.txt.gz").write_bytes(b"plain text, not gzip")
    (d / "c_truncated.jsonl.gz").write_bytes(gzip.compress(good)[:-20])
    (d / "d_not_zstd.jsonl.zst").write_bytes(b"plain text, not zstd")
    (d / "e_truncated.jsonl.zst").write_bytes(zst(good)[:-10])
    flipped = bytearray(gzip.compress(good, mtime=0))
    flipped[len(flipped) // 2] ^= 0xFF
    (d / "f_flipped.txt.gz").write_bytes(bytes(flipped))
    (d / "g_good.txt.zst").write_bytes(zst(b"still read\n"))
    res = read_inputs([str(d)])
    assert res.skipped["bad_compressed_file"] == 5
    names = [x.name for x in res.docs]
    assert names[:200] == [f"a_good.jsonl.gz:{i}" for i in range(1, 201)] and names[-1] == "g_good.txt.zst"
    # the documents a truncated jsonl.gz yielded before the damage stay (gzip keeps its last block back)
    assert all(n.startswith(("a_good", "c_truncated", "g_good")) for n in names)


def test_a_build_reads_jsonl_gz_end_to_end(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for f in range(3):
        lines = [json.dumps({"text": f"file {f} doc {i} " + "word " * (5 + 7 * i)}) for i in range(8)]
        (d / f"part{f}.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    (d / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    out = tmp_path / "store"
    assert longctx_main(["data", "build", "--input", str(d), "--seq-len", "64", "--out", str(out),
                         "--no-progress", "--workers", "1"]) == 0
    manifest = (out / "manifest.json").read_text()
    assert json.loads(manifest)["totals"]["documents"] == 24
    assert json.loads(manifest)["totals"]["files_skipped"] == 1 and '"bad_compressed_file": 1' in manifest


def tracked_open(monkeypatch):
    """Patch the reader's open() to count the bytes read from disk; Path.read_bytes fails."""
    read = {"bytes": 0}

    class Counted(io.BufferedReader):
        def read(self, n=-1):
            data = super().read(n)
            read["bytes"] += len(data)
            return data

    monkeypatch.setattr(readers, "open", lambda p, mode="r": Counted(io.FileIO(p, mode)), raising=False)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("a whole-file read"))
    return read


@pytest.mark.parametrize("suffix, compress", [("", None), (".gz", gzip.compress), (".zst", zst)])
def test_iter_file_streams_jsonl(tmp_path, monkeypatch, suffix, compress):
    monkeypatch.setattr(readers, "CHUNK", 4096)
    # hashes: the compressed files stay large too
    raw = b"".join(json.dumps({"text": f"record {i} " + hashlib.sha256(b"%d" % i).hexdigest()}).encode() + b"\n"
                   for i in range(20000))
    path = tmp_path / f"big.jsonl{suffix}"
    path.write_bytes(compress(raw) if compress else raw)
    read = tracked_open(monkeypatch)
    docs = iter_file(path, path.name, "text", Counter())
    first = next(docs)
    assert first.name == f"big.jsonl{suffix}:1" and first.text.startswith("record 0 ")
    # only the first chunks so far (zstd decodes whole blocks, up to 128 KiB of output each)
    assert read["bytes"] < path.stat().st_size / 8
    rest = list(docs)
    assert len(rest) == 19999 and rest[-1].name.endswith(":20000")
    assert read["bytes"] == path.stat().st_size


def test_read_inputs_max_docs_stops_inside_a_file(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(100)))
    (tmp_path / "b.txt").write_text("after")
    res = read_inputs([str(tmp_path)], max_docs=7)
    assert [d.text for d in res.docs] == [f"d{i}" for i in range(7)] and res.files == 1
    assert res.bytes == sum(len(d.text) for d in res.docs)


def test_hand_written_saved_dataset_and_dataset_dict(tmp_path):
    ds = hand_saved_dataset(tmp_path / "ds", [["a1", "a2", "a3"], ["b1", None, "b3"]])
    res = read_inputs([str(ds)])
    assert [(d.name, d.text) for d in res.docs] == [
        ("ds/data-00000-of-00002.arrow:1", "a1"), ("ds/data-00000-of-00002.arrow:2", "a2"),
        ("ds/data-00000-of-00002.arrow:3", "a3"), ("ds/data-00001-of-00002.arrow:1", "b1"),
        ("ds/data-00001-of-00002.arrow:3", "b3")]
    assert res.skipped["missing_text_field"] == 1 and res.files == 2
    root, units, _ = input_files(str(ds))
    assert root == ds.absolute().parent and [u.name for u in units] == ["data-00000-of-00002.arrow",
                                                                        "data-00001-of-00002.arrow"]
    assert unit_size(units[0]) == units[0].stat().st_size > 0

    # a DatasetDict: splits in dataset_dict.json's order (not sorted), inside a directory with other files
    top = tmp_path / "top"
    hand_saved_dataset(top / "dd" / "train", [["t1", "t2"]])
    hand_saved_dataset(top / "dd" / "test", [["e1"]])
    (top / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    (top / "dd" / "train" / "cache-1234.arrow").write_bytes(b"not listed")  # not part of the dataset
    (top / "a.txt").write_text("before")
    (top / "z.md").write_text("after")
    (top / "config.json").write_text('{"a json file": "outside a dataset is a text document"}')
    res = read_inputs([str(top)])
    assert [d.name for d in res.docs] == ["a.txt", "config.json", "dd/train/data-00000-of-00001.arrow:1",
                                          "dd/train/data-00000-of-00001.arrow:2", "dd/test/data-00000-of-00001.arrow:1",
                                          "z.md"]
    assert res.skipped["other_suffix"] == 1
    assert [d.name for d in read_inputs([str(top / "dd")]).docs][-1] == "dd/test/data-00000-of-00001.arrow:1"


def test_saved_dataset_errors(tmp_path):
    ds = hand_saved_dataset(tmp_path / "ds", [["a"]], extra={"content": ["c"]})
    with pytest.raises(DataError, match=r"arrow file .* no column 'body' \(columns: text, id, content\).*--text-field"):
        read_inputs([str(ds)], text_field="body")
    assert [d.text for d in read_inputs([str(ds)], text_field="content").docs] == ["c"]
    (ds / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(DataError, match="lists the data file 'data-00000-of-00001.arrow'"):
        input_files(str(tmp_path))
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match="lists the split 'train'"):
        input_files(str(dd))


def test_lone_arrow_files(tmp_path):
    t = pa.table({"text": ["s1", "s2", "s3"]})
    stream_file(tmp_path / "s.arrow", t)
    with ipc.new_file(tmp_path / "f.arrow", t.schema) as w:  # the random-access IPC file format
        w.write_table(t)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all" * 10)
    res = read_inputs([str(tmp_path)])
    assert [d.name for d in res.docs] == ["f.arrow:1", "f.arrow:2", "f.arrow:3", "s.arrow:1", "s.arrow:2", "s.arrow:3"]
    assert res.skipped["bad_arrow_file"] == 1


def test_datasets_save_to_disk_reads_back(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    texts = [f"document {i}" for i in range(7)]
    datasets.Dataset.from_dict({"text": texts, "n": list(range(7))}).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    res = read_inputs([str(tmp_path / "ds")])
    assert [d.text for d in res.docs] == texts
    names = [d.name for d in res.docs]
    assert names[0] == "ds/data-00000-of-00002.arrow:1" and names[-1].startswith("ds/data-00001-of-00002.arrow:")
    assert len(set(names)) == 7

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t1", "t2"]}),
                               "validation": datasets.Dataset.from_dict({"text": ["v1"]})})
    dd.save_to_disk(str(tmp_path / "inside" / "dd"))
    res = read_inputs([str(tmp_path / "inside")])
    assert [(d.name, d.text) for d in res.docs] == [("dd/train/data-00000-of-00001.arrow:1", "t1"),
                                                    ("dd/train/data-00000-of-00001.arrow:2", "t2"),
                                                    ("dd/validation/data-00000-of-00001.arrow:1", "v1")]
    assert not res.skipped["other_suffix"]
    with pytest.raises(DataError, match=r"no column 'content' \(columns: text\)"):
        read_inputs([str(tmp_path / "inside" / "dd")], text_field="content")


def without(monkeypatch, module):
    real = builtins.__import__

    def refuse(name, *a, **k):
        if name.startswith(module):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", refuse)


def test_missing_zstandard_is_an_error_before_reading(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("plain")
    (tmp_path / "b.jsonl.zst").write_bytes(zst(b'{"text": "x"}\n'))
    without(monkeypatch, "zstandard")
    with pytest.raises(DataError, match=r"needs zstandard.*pip install zstandard"):
        input_files(str(tmp_path))
    with pytest.raises(DataError, match=r"pip install 'longctx\[data\]'"):
        read_inputs([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.zst")])
    assert [d.text for d in read_inputs([str(tmp_path / "a.txt")]).docs] == ["plain"]
