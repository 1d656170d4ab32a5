"""A data.path that is no store says what it is instead: a directory of stores (data.path naming their parent)
was told it "holds an unfinished build; run `longctx data build` again" (a build into it is refused), as was a
shard scan, which needs `data merge`; a store's manifest.json given as the store names its directory."""

import random

import pytest

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.errors import DataError


def _build(src, out, **kw):
    if not src.exists():
        src.mkdir(parents=True)
        rng = random.Random(0)
        for i in range(6):
            (src / f"d{i}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef"]) for _ in range(30)) + f" {i}")
    build_store(BuildOptions([str(src)], str(out), 64, strategy="bfd", dedup="none", workers=1, progress=False,
                             stats=False, **kw), log=lambda *a, **k: None)


def test_a_directory_of_stores_is_said_to_be_one_naming_its_stores(tmp_path):
    for name in ("books", "code"):
        _build(tmp_path / "in", tmp_path / "stores" / name)
    with pytest.raises(DataError) as e:
        PackedSamples(tmp_path / "stores")
    said = str(e.value)
    assert "directory of stores" in said and str(tmp_path / "stores" / "books") in said, said
    assert str(tmp_path / "stores" / "code") in said and "holds an unfinished build" not in said, said


def test_a_manifest_file_names_its_store_directory(tmp_path):
    _build(tmp_path / "in", tmp_path / "s")
    with pytest.raises(DataError, match=f"manifest file: name its directory, {tmp_path / 's'}"):
        PackedSamples(tmp_path / "s" / "manifest.json")


def test_a_shard_scan_is_said_to_need_a_merge(tmp_path):
    _build(tmp_path / "in", tmp_path / "scan", shard=(0, 1))
    with pytest.raises(DataError, match="shard scan .*longctx data merge") as e:
        PackedSamples(tmp_path / "scan")
    assert "holds an unfinished build" not in str(e.value)


def test_an_unfinished_build_and_a_missing_path_are_said_as_before(tmp_path):
    (tmp_path / "s" / ".build").mkdir(parents=True)
    with pytest.raises(DataError, match="unfinished build .* Build one with"):
        PackedSamples(tmp_path / "s")
    with pytest.raises(DataError, match="is not a longctx data store: .* Build one with") as e:
        PackedSamples(tmp_path / "none")
    assert "holds an unfinished build" not in str(e.value)


def test_a_directory_of_text_is_told_to_be_built_into_a_store_not_finished(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text")
    with pytest.raises(DataError, match=f"holds other files \\(a.txt\\).*--input {tmp_path / 'corpus'} .*--out DIR"):
        PackedSamples(tmp_path / "corpus")


def test_a_corpus_file_given_as_the_store_is_told_to_be_built_as_input(tmp_path):
    """data.path naming a .jsonl corpus: the advice was `longctx data build --input PATH --out <the file>`,
    which data build refuses (--out exists and is not a directory)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    with pytest.raises(DataError) as e:
        PackedSamples(corpus)
    said = " ".join(str(e.value).split())
    assert f"--input {corpus} --seq-len N --out DIR" in said and f"--out {corpus}" not in said
