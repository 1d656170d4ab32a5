"""Merging shard scans and appending to a store: scans of different machine counts or cut-short copies are
refused at merge, machines may choose their own --workers, and an append keeps the store's eval fraction."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_data_build import quiet, text_doc
from test_data_stream import corpus, opts, part_files, small_shards  # noqa: F401 (a fixture)

from longctx.data import store
from longctx.data.builder import pipeline, scan
from longctx.data.builder.holdout import eval_rank, is_eval_doc
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.loader import PackedSamples
from longctx.errors import DataError


def scans(src, tmp_path, machines, **kw):
    return [str(build_store(opts([src], tmp_path / f"scan{i}_{n}", shard=(i, n), **kw), log=quiet) and
                tmp_path / f"scan{i}_{n}") for i, n in machines]


def test_scans_of_another_machine_count_are_refused_not_merged_short(tmp_path, small_shards):  # noqa: F811
    src = corpus(tmp_path / "in", seed=4)
    # 0/2 scans the first half, 1/3 the middle third: merged, the last third was silently missing
    with pytest.raises(DataError, match=r"--shard 1/3"):
        merge_scans(scans(src, tmp_path, [(0, 2), (1, 3)]), str(tmp_path / "m"), progress=False, log=quiet)
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_machines_with_their_own_workers_merge_into_the_store_of_one_build(tmp_path, small_shards):  # noqa: F811
    src = corpus(tmp_path / "in", seed=5)
    build_store(opts([src], tmp_path / "one", eval_fraction=0.1), log=quiet)
    dirs = [str(build_store(opts([src], tmp_path / f"scan{i}", shard=(i, 2), eval_fraction=0.1, workers=1 + i,
                                 max_memory=(1 + i) << 30), log=quiet) and tmp_path / f"scan{i}") for i in range(2)]
    merge_scans(dirs, str(tmp_path / "m"), progress=False, log=quiet)
    assert part_files(tmp_path / "m") == part_files(tmp_path / "one")


@pytest.mark.parametrize("name", ["text.bin", "tokens.bin", "sigs.npy", "names.jsonl"])
def test_a_scan_copied_in_part_is_refused_at_merge(tmp_path, small_shards, name):  # noqa: F811
    src = corpus(tmp_path / "in", seed=6)
    dirs = scans(src, tmp_path, [(0, 2), (1, 2)])
    shard = sorted((tmp_path / "scan1_2" / "shards").iterdir())[-1]
    data = (shard / name).read_bytes()
    (shard / name).write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="is damaged"):
        merge_scans(dirs, str(tmp_path / "m"), progress=False, log=quiet)


def test_an_append_with_another_eval_fraction_is_refused(tmp_path):
    rng = random.Random(0)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    texts = {f"d{i}.txt": text_doc(rng, 30) for i in range(20)}  # (each fits a sample: held out whole)
    for name, text in texts.items():
        (a / name).write_text(text)
    held = next(n for n in texts if is_eval_doc(n, 0.3))
    words = texts[held].split(" ")
    words[:len(words) // 2] = [f"new{j}" for j in range(len(words) // 2)]  # a revision of an eval document
    (b / held).write_text(" ".join(words))
    build_store(opts([a], tmp_path / "s", eval_fraction=0.3), log=quiet)
    with pytest.raises(DataError, match="eval_fraction 0.3"):
        build_store(opts([b], tmp_path / "s", append=True), log=quiet)  # (--eval-fraction forgotten: 0)
    # (the append holds one document, held out: a part of eval samples only, which training reads past)
    m = build_store(opts([b], tmp_path / "s", append=True, eval_fraction=0.3), log=quiet)
    assert m["parts"][1]["splits"]["train"]["samples"] == 0
    assert len(PackedSamples(tmp_path / "s", "eval")) == m["totals"]["eval_samples"]
    assert len(PackedSamples(tmp_path / "s", "train")) == m["totals"]["train_samples"] > 0

    def splits(part):
        return {d["name"]: d["split"] for d in map(json.loads, (tmp_path / "s" / part / "docs.jsonl").open())}
    assert splits("part-00000")[held] == "eval" and splits("part-00001") == {held: "eval"}  # as its first version


def test_a_loss_gaps_file_cut_short_is_a_damaged_store(tmp_path):
    np.save(tmp_path / "loss_gaps.offsets.npy", np.array([0, 2, 4], np.int64))
    np.array([5, 9, 3], np.int64).tofile(tmp_path / "loss_gaps.bin")  # the last gap lost
    with pytest.raises(DataError, match="holds 3 gaps, its offsets 4"):
        store.load_loss_gaps(tmp_path)


def test_shards_left_without_their_plan_are_not_taken_for_an_appends_inputs(tmp_path, small_shards,  # noqa: F811
                                                                             monkeypatch):
    rng = random.Random(1)
    a, b = tmp_path / "a", tmp_path / "b"
    for d, n in ((a, 6), (b, 12)):
        d.mkdir()
        for i in range(n):
            (d / f"{d.name}{i}.txt").write_text(text_doc(rng, 500))
    real = shutil.rmtree

    def killed_while_removing(path, *args, **kw):  # the build's work directory: its plan gone, then killed
        if Path(path).name == pipeline.WORK:
            (Path(path) / scan.PLAN).unlink(missing_ok=True)
            raise KeyboardInterrupt
        return real(path, *args, **kw)

    monkeypatch.setattr(shutil, "rmtree", killed_while_removing)
    with pytest.raises(KeyboardInterrupt):
        build_store(opts([a], tmp_path / "s"), log=quiet)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert (tmp_path / "s" / pipeline.WORK / scan.SHARDS).is_dir()
    build_store(opts([b], tmp_path / "s", append=True), log=quiet)
    names = [json.loads(x)["name"] for x in (tmp_path / "s/part-00001/docs.jsonl").read_text().splitlines()]
    assert sorted(names) == sorted(f"b{i}.txt" for i in range(12))


def test_an_append_holds_out_no_revision_of_a_trained_document_by_the_fallback(tmp_path):
    rng = random.Random(2)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    texts = {f"d{i}.txt": text_doc(rng, 30) for i in range(20)}
    for name, text in texts.items():
        (a / name).write_text(text)
    trained = min((n for n in texts if not is_eval_doc(n, 0.3)), key=eval_rank)
    words = texts[trained].split(" ")
    words[:len(words) // 2] = [f"new{j}" for j in range(len(words) // 2)]  # a revision, not a near copy
    (b / trained).write_text(" ".join(words))
    other = next(f"new{i}.txt" for i in range(99)
                 if eval_rank(f"new{i}.txt") > eval_rank(trained) and not is_eval_doc(f"new{i}.txt", 0.3))
    (b / other).write_text(text_doc(rng, 30))
    assert build_store(opts([a], tmp_path / "s", eval_fraction=0.3), log=quiet)["totals"]["eval_samples"]
    build_store(opts([b], tmp_path / "s", eval_fraction=0.3, append=True), log=quiet)
    splits = {d["name"]: d["split"] for d in map(json.loads, (tmp_path / "s/part-00001/docs.jsonl").open())}
    assert splits == {trained: "train", other: "train"}  # (the fallback would hold out the revision)
