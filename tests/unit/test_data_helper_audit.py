"""Helper `data` audit: a store damaged after it was written (a hand edit, another tool) is refused with a message
that names the file and the fix; inputs reached through symlinked directories are read, unlistable ones refused."""

import json

import pytest

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.errors import DataError


def quiet(*_):
    pass


@pytest.fixture
def store(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for i, text in enumerate(["hello world", "zzz zzz zzz", "abc def ghi jkl"]):
        (d / f"{i}.txt").write_text(text)
    build_store(BuildOptions([str(d)], str(tmp_path / "s"), 16, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=0.0, progress=False, stats=False), log=quiet)
    return tmp_path / "s"


def test_token_ids_past_the_manifests_vocabulary_are_refused_on_read(store):
    # train checks model.vocab_size >= the manifest's vocab_size; an id past it (here 'z' = 122 >= 100) would be
    # an IndexError in the embedding (a device-side assert on a GPU)
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tokenizer"]["vocab_size"] = 100
    path.write_text(json.dumps(manifest))
    samples = PackedSamples(store)
    with pytest.raises(DataError, match=r"part-00000/train\.tokens\.npy holds token id \d+.*100 ids.*rebuild"):
        samples.batch(range(len(samples)))


def test_a_symlinked_directory_in_an_input_is_read_once_and_a_loop_adds_nothing(tmp_path):
    from longctx.data.builder.inputs import input_files

    (tmp_path / "in").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "in" / "a.txt").write_text("first")
    (tmp_path / "elsewhere" / "b.txt").write_text("second")
    (tmp_path / "in" / "books").symlink_to(tmp_path / "elsewhere")  # a corpus assembled from links
    (tmp_path / "in" / "loop").symlink_to(tmp_path / "in")  # back to itself
    (tmp_path / "in" / "up").symlink_to(tmp_path)  # above it: holds `in` again, and what is not the input
    (tmp_path / "stray.txt").write_text("not in the input")
    (tmp_path / "in" / "again").symlink_to(tmp_path / "elsewhere")  # the same directory twice
    root, files, skipped = input_files(str(tmp_path / "in"))
    assert [f.relative_to(root).as_posix() for f in files] == ["a.txt", "again/b.txt"]
    assert skipped == 0


def test_an_input_directory_that_cannot_be_listed_is_refused(tmp_path, monkeypatch):
    import os

    from longctx.data.builder import inputs

    (tmp_path / "in" / "locked").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("first")
    real_scandir = os.scandir

    def scandir(path):  # (chmod 000 does not stop root, who runs the tests in CI)
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(DataError, match=r"'.*locked' cannot be listed \(Permission denied\).*make it readable"):
        inputs.input_files(str(tmp_path / "in"))


@pytest.mark.parametrize("name", ["hashes.npy", "minhash.npy"])
def test_an_append_refuses_a_part_whose_dedup_rows_disagree_with_its_documents(tmp_path, name):
    import numpy as np

    d = tmp_path / "in"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"document number {i} " + "word " * (10 + 7 * i))
    build_store(BuildOptions([str(d)], str(tmp_path / "s"), 64, strategy="bfd", workers=1, progress=False,
                             stats=False), log=quiet)
    path = tmp_path / "s" / "part-00000" / name
    np.save(path, np.load(path)[:-1])  # a document's row lost: a copy of it appended would be kept, unsaid
    more = tmp_path / "more"
    more.mkdir()
    (more / "copy.txt").write_text((d / "3.txt").read_text())
    with pytest.raises(DataError, match=rf"part-00000/{name} holds 3 documents' rows, its manifest 4 documents"):
        build_store(BuildOptions([str(more)], str(tmp_path / "s"), 64, strategy="bfd", workers=1, progress=False,
                                 stats=False, append=True), log=quiet)


@pytest.mark.parametrize("option", ["--data.max_docs=5", "--data.eval_fraction=0.3", "--data.strategy=bfd",
                                    "--data.dedup=none", "--data.workers=3"])
def test_store_build_options_beside_data_path_are_refused_not_ignored(tmp_path, option):
    # each configures the store built from data.corpus: beside data.path it was accepted, the run trained on the
    # whole store as built, and its config.toml named the option as if it applied
    from longctx.config import load_config
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"{option.split('=')[0][2:]} = .* would be ignored.*data.path"):
        load_config(None, [f"--data.path={tmp_path}", option])
    load_config(None, [option])  # (without data.path each applies)


@pytest.mark.parametrize("damage", ["cut tokens", "lost sigs"])
def test_a_resumed_build_scans_again_a_finished_shard_damaged_since(tmp_path, monkeypatch, damage):
    # a finished shard (its shard.json written) whose files were cut or lost after it: the resumed build read it as
    # it was (a ValueError in the packing, a FileNotFoundError), where it must scan it again
    from test_data_build_failures import by_hand, corpus, dies_on_call, part_files, stored

    from longctx.data import store
    from longctx.data.builder import pipeline, scan

    monkeypatch.setattr(scan, "SHARD_BYTES", 3000)
    texts = corpus(tmp_path / "in")
    kw = dict(seq_len=128, dedup="minhash", workers=1, progress=False, stats=False, eval_fraction=0.3)
    build_store(BuildOptions([str(tmp_path / "in")], str(tmp_path / "whole"), **kw), log=quiet)
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        dies_on_call(mp, store, "write_manifest", 1)  # killed after the scan: every shard finished
        build_store(BuildOptions([str(tmp_path / "in")], str(tmp_path / "s"), **kw), log=quiet)
    shard = tmp_path / "s" / pipeline.WORK / scan.SHARDS / "000001"
    if damage == "cut tokens":
        with open(shard / "tokens.bin", "r+b") as f:
            f.truncate(f.seek(0, 2) - 10)
    else:
        (shard / "sigs.npy").unlink()
    lines = []
    build_store(BuildOptions([str(tmp_path / "in")], str(tmp_path / "s"), **kw), log=lines.append)
    assert any("000001 is damaged" in line and "scanning it again" in line for line in lines)
    assert part_files(tmp_path / "s") == part_files(tmp_path / "whole")
    assert stored(tmp_path / "s") == by_hand(texts)


@pytest.mark.parametrize("text", ["inf", "1e400GB", "-inf"])
def test_an_infinite_max_memory_is_refused_not_an_overflow_traceback(text):
    from longctx.data.builder.options import parse_memory

    with pytest.raises(DataError, match="is not a size"):
        parse_memory(text)


@pytest.mark.parametrize("dedup", ["exact", "none"])
def test_a_dedup_threshold_without_minhash_is_refused_not_ignored(tmp_path, dedup):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a document")
    with pytest.raises(DataError, match=rf"--dedup-threshold 0.5 would be ignored.*--dedup {dedup}"):
        build_store(BuildOptions([str(tmp_path / "in")], str(tmp_path / "s"), 16, dedup=dedup, dedup_threshold=0.5,
                                 workers=1, progress=False, stats=False), log=quiet)
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_a_file_reached_twice_through_links_is_stored_once_under_dedup_none(tmp_path):
    # in/books links to `other`, also an --input, and in/alias.txt to in/a.txt: each file's documents once
    from longctx.data.builder.inputs import read_inputs

    (tmp_path / "in").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "in" / "a.txt").write_text("first document")
    (tmp_path / "other" / "b.txt").write_text("second document")
    (tmp_path / "in" / "alias.txt").symlink_to(tmp_path / "in" / "a.txt")
    (tmp_path / "in" / "books").symlink_to(tmp_path / "other")
    inputs = [str(tmp_path / "in"), str(tmp_path / "other")]
    build_store(BuildOptions(inputs, str(tmp_path / "s"), 32, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=0.0, progress=False, stats=False), log=quiet)
    lines = (tmp_path / "s" / "part-00000" / "docs.jsonl").read_text().splitlines()
    names = [json.loads(line)["name"] for line in lines]
    assert names == ["a.txt", "books/b.txt"]
    assert [d.name for d in read_inputs(inputs).docs] == names  # (the in-memory reference reads the same)


def test_an_append_after_a_part_was_dropped_from_the_manifest_keeps_every_listed_part(tmp_path):
    # a bad append dropped from the manifest by hand (parts part-00000, part-00002): the next append was numbered by
    # the count of parts, took the name part-00002, removed that listed part's files and listed its own twice
    kw = dict(strategy="bfd", workers=1, progress=False, stats=False, eval_fraction=0.0)
    for i in range(4):
        (tmp_path / f"in{i}").mkdir()
        (tmp_path / f"in{i}" / "a.txt").write_text(f"batch {i}: " + "words of its own " * (i + 2))
        build_store(BuildOptions([str(tmp_path / f"in{i}")], str(tmp_path / "s"), 64, append=i > 0, **kw), log=quiet)
        if i == 2:
            path = tmp_path / "s" / "manifest.json"
            manifest = json.loads(path.read_text())
            manifest["parts"] = [p for p in manifest["parts"] if p["dir"] != "part-00001"]
            path.write_text(json.dumps(manifest))
            before = (tmp_path / "s" / "part-00002" / "train.tokens.npy").read_bytes()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert [(p["dir"], p["inputs"]) for p in manifest["parts"]] == [
        ("part-00000", [str(tmp_path / "in0")]), ("part-00002", [str(tmp_path / "in2")]),
        ("part-00003", [str(tmp_path / "in3")])]
    assert (tmp_path / "s" / "part-00002" / "train.tokens.npy").read_bytes() == before
    assert len(PackedSamples(tmp_path / "s")) == sum(p["splits"]["train"]["samples"] for p in manifest["parts"])


@pytest.mark.parametrize("edit, said", [
    (lambda m: m.pop("seq_len"), "seq_len is None where a count"),
    (lambda m: m["parts"][0].pop("splits"), r"parts\[0\].splits.train.samples is None"),
    (lambda m: m["tokenizer"].pop("vocab_size"), "tokenizer.vocab_size is None"),
    (lambda m: m["parts"][0]["splits"]["train"].update(samples="3"), r"parts\[0\].splits.train.samples is '3'"),
    (lambda m: m.update(parts={}), "parts is dict, not a list"),
    (lambda m: m["parts"][0].update(dir="../other/part-00000"), r"parts\[0\].dir is '../other/part-00000'"),
])
def test_a_manifest_edited_by_hand_is_refused_naming_the_field_not_a_key_error(store, edit, said):
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"manifest.json is damaged: {said}.*rebuild the store"):
        PackedSamples(store)
