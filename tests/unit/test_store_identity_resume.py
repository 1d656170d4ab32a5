"""A checkpoint's data position records the identity of the store its cursor points into (data/loader.py
store_identity): a store rebuilt in place with other content but the same number of training samples is
refused on resume (before, the sample count and the seed were all that was checked, and the run went on
with its cursor in other data; so is one whose counts all agree but whose text does not), unless
--checkpoint.allow_changes asks to continue on it (said). The same content keeps its identity wherever it
lies and however often it is rebuilt; a position saved before identities were recorded resumes unchecked;
with train.stages each stage's position carries its stage's."""

import json
import os
import shutil

import pytest

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import BatchLoader, PackedSamples
from longctx.errors import DataError
from longctx.train.stages import StagedLoader
from longctx.train.trainer import Trainer

SEQ = 64
BASE = [f"--train.seq_len={SEQ}", "--train.global_batch=2", "--train.eval_interval=0", "--train.warmup_steps=1",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2"]


def quiet(*_a, **_k):
    pass


def corpus(d, n_docs, doc_bytes, letter):
    """n_docs documents of doc_bytes bytes (+ EOS each): with doc_bytes + 1 > seq_len / 2, one per sample."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for i in range(n_docs):
        (d / f"d{i:02d}.txt").write_text((letter + chr(ord("a") + i % 26)) * (doc_bytes // 2) + "x" * (doc_bytes % 2))
    return d


def build(src, out, seq_len=SEQ, eval_fraction=0.0):
    shutil.rmtree(out, ignore_errors=True)
    build_store(BuildOptions([str(src)], str(out), seq_len, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=eval_fraction, progress=False, stats=False), log=quiet)
    return out


def two_stores(tmp_path, seq_len=SEQ):
    """The corpus a run trained on, and another one of the same number of documents (so of samples), each
    document shorter: other tokens, the same train sample count. Both read from `in` (the same inputs)."""
    a = corpus(tmp_path / "a", 8, seq_len - 1, "p")
    b = corpus(tmp_path / "b", 8, seq_len * 3 // 4, "q")
    return a, b


def trained_run(tmp_path):
    """A 2-step run on the store at tmp_path/s (built from tmp_path/in = corpus a), saved at step 2."""
    a, _ = two_stores(tmp_path)
    src = tmp_path / "in"
    shutil.copytree(a, src)
    build(src, tmp_path / "s")
    Trainer(load_config(None, [*BASE, f"--data.path={tmp_path / 's'}", f"--train.run_dir={tmp_path / 'run'}",
                               "--train.steps=2"]), log=quiet).run()
    return src


def resume(tmp_path, *extra, log=quiet):
    cfg, _ = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path / 'run'}",
                                    "--train.steps=3", *extra], layout_given=False)
    return Trainer(cfg, log=log)


def saved_position(tmp_path, step):
    state = tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "trainer_state.json"
    return json.loads(state.read_text())["sampler"]


def test_a_store_rebuilt_with_other_content_and_the_same_sample_count_is_refused(tmp_path):
    src = trained_run(tmp_path)
    before = PackedSamples(tmp_path / "s")
    _, b = two_stores(tmp_path)
    shutil.rmtree(src)
    shutil.copytree(b, src)
    build(src, tmp_path / "s")  # the same data.path, inputs and settings: other documents
    after = PackedSamples(tmp_path / "s")
    assert len(after) == len(before) == 8 and after.num_tokens != before.num_tokens
    with pytest.raises(DataError) as e:
        resume(tmp_path)
    msg = str(e.value)
    assert "rebuilt with other content" in msg and "--checkpoint.allow_changes true" in msg
    assert f"{before.num_tokens:,} tokens" in msg and f"{after.num_tokens:,} tokens" in msg


def test_a_store_rebuilt_with_the_same_counts_but_other_text_is_refused(tmp_path):
    """One document's letters changed in place: every count (files, bytes, documents, tokens, samples) is the
    same, only the text differs; the identity's digest of the documents' contents tells them apart."""
    src = trained_run(tmp_path)
    before = PackedSamples(tmp_path / "s")
    doc = src / "d03.txt"
    doc.write_text(doc.read_text().replace("p", "r"))
    build(src, tmp_path / "s")
    after = PackedSamples(tmp_path / "s")
    assert (len(after), after.num_tokens) == (len(before), before.num_tokens)
    assert after.manifest["parts"][0]["counts"] == before.manifest["parts"][0]["counts"]
    assert after.identity["identity"] != before.identity["identity"]
    with pytest.raises(DataError, match="rebuilt with other content"):
        resume(tmp_path)


def test_a_store_built_before_the_digest_was_recorded_has_the_same_identity(tmp_path):
    """The builder records each part's documents digest in the manifest (no hashes.npy read at open); a
    manifest without it (a store built before) gets the same digest from hashes.npy, and so the same identity."""
    from longctx.data.store import MANIFEST, documents_digest

    a, _ = two_stores(tmp_path)
    root = build(a, tmp_path / "s")
    manifest = json.loads((root / MANIFEST).read_text())
    [part] = manifest["parts"]
    assert part["documents_digest"] == documents_digest(root / part["dir"]) is not None
    recorded = PackedSamples(root).identity
    del part["documents_digest"]
    (root / MANIFEST).write_text(json.dumps(manifest))
    assert PackedSamples(root).identity == recorded


def test_allow_changes_continues_on_the_new_store_from_the_same_cursor_and_says_so(tmp_path):
    src = trained_run(tmp_path)
    cursor = saved_position(tmp_path, 2)["cursor"]
    _, b = two_stores(tmp_path)
    shutil.rmtree(src)
    shutil.copytree(b, src)
    build(src, tmp_path / "s")
    said = []
    trainer = resume(tmp_path, "--checkpoint.allow_changes=true", log=lambda *a, **_: said.append(str(a)))
    assert trainer.sampler.loader.order.cursor == cursor == 4  # 2 steps of 2 samples
    assert any("continuing on the new data from the same cursor" in s for s in said)
    trainer.run()
    # what is saved from here on is a position in the new store
    assert saved_position(tmp_path, 3)["store"] == PackedSamples(tmp_path / "s").identity


def test_a_store_of_another_sample_count_is_refused_naming_allow_changes_which_continues_on_it(tmp_path):
    """Documents added (10 samples where the run drew from 8): refused, saying how to go on anyway; with
    --checkpoint.allow_changes the cursor indexes the new store's own order (said), and what is saved next
    is a position in it, drawn on from that cursor."""
    src = trained_run(tmp_path)
    for i in (8, 9):
        (src / f"d{i:02d}.txt").write_text("zz" * 31 + "x")
    build(src, tmp_path / "s")
    assert len(PackedSamples(tmp_path / "s")) == 10
    with pytest.raises(DataError) as e:
        resume(tmp_path)
    assert "8 train samples" in str(e.value) and "10 train samples" in str(e.value)
    assert "--checkpoint.allow_changes true" in str(e.value)
    said = []
    trainer = resume(tmp_path, "--checkpoint.allow_changes=true", log=lambda *a, **_: said.append(str(a)))
    assert trainer.sampler.loader.order.cursor == 4
    assert any("continuing at sample 4 of epoch 0 of this data's own order" in s for s in said)
    trainer.run()
    saved = saved_position(tmp_path, 3)
    assert (saved["num_samples"], saved["cursor"]) == (10, 6)
    assert saved["store"] == PackedSamples(tmp_path / "s").identity


def test_the_same_store_moved_or_rebuilt_identically_resumes(tmp_path):
    src = trained_run(tmp_path)
    saved = saved_position(tmp_path, 2)["store"]
    # rebuilt from the same inputs into the same place: its parts have new creation times and timings
    (src / "d00.txt").touch()
    build(src, tmp_path / "s")
    assert PackedSamples(tmp_path / "s").identity == saved
    said = []
    trainer = resume(tmp_path, log=lambda *a, **_: said.append(str(a)))
    assert trainer.start_step == 2 and trainer.sampler.loader.order.cursor == 4
    assert not any("cursor" in s for s in said)
    # moved elsewhere (data.path changed: a config change, so asked for; the loader knows the store again)
    os.rename(tmp_path / "s", tmp_path / "moved")
    assert PackedSamples(tmp_path / "moved").identity == saved
    moved = BatchLoader(PackedSamples(tmp_path / "moved"), 2, seed=0)
    assert moved.load_state_dict(saved_position(tmp_path, 2)) is None and moved.order.cursor == 4


def test_a_position_saved_before_identities_were_recorded_resumes_unchecked(tmp_path):
    a, b = two_stores(tmp_path)
    old = BatchLoader(PackedSamples(build(a, tmp_path / "s")), 2, seed=0)
    old.next_indices()
    position = {k: v for k, v in old.state_dict().items() if k != "store"}  # as an older longctx saved it
    assert set(position) == {"cursor", "seed", "num_samples"}
    other = BatchLoader(PackedSamples(build(b, tmp_path / "s")), 2, seed=0)
    assert other.load_state_dict(position) is None and other.order.cursor == 2


def test_the_default_store_and_a_data_build_store_of_the_same_corpus_share_an_identity(tmp_path, monkeypatch):
    from longctx.data.default_store import default_store

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    src, _ = two_stores(tmp_path)
    data = load_config(None, [f"--data.corpus={src}", "--data.tokenizer=byte", "--data.dedup=none",
                              "--data.strategy=bfd", "--data.workers=1"]).data
    cached = default_store(data, SEQ, log=quiet)
    built = build(src, tmp_path / "built", eval_fraction=data.eval_fraction)  # (the default store's fraction)
    assert PackedSamples(cached).identity == PackedSamples(built).identity
    # the corpus touched: the cache key changes, so the store is built again elsewhere, with the same identity
    (src / "d01.txt").touch()
    os.utime(src / "d01.txt", ns=(1, 1))
    again = default_store(data, SEQ, log=quiet)
    assert again != cached and PackedSamples(again).identity == PackedSamples(cached).identity


def _staged(tmp_path, stores, allow=False):
    """A StagedLoader of stages 8:2,16:2 reading the given store per seq_len."""
    cfg = load_config(None, ["--train.stages=8:2,16:2", "--train.eval_interval=0", "--train.global_batch=2",
                             f"--checkpoint.allow_changes={str(allow).lower()}"])
    return StagedLoader(cfg, lambda c: (PackedSamples(stores[c.train.seq_len]), None), dp=1)


def test_each_stage_position_carries_its_stage_store_and_a_rebuilt_one_is_refused(tmp_path):
    stores = {}
    for L in (8, 16):
        a, _ = two_stores(tmp_path / f"c{L}", L)
        stores[L] = build(a, tmp_path / f"s{L}", L)
    run = _staged(tmp_path, stores)
    run.enter(1)
    run.step_batches(1)
    in_first = run.state_dict()
    assert in_first["stage"] == 0 and in_first["store"] == PackedSamples(stores[8]).identity
    run.step_batches(2)
    run.enter(3)
    run.step_batches(3)
    in_second = run.state_dict()
    assert in_second["stage"] == 1 and in_second["store"] == PackedSamples(stores[16]).identity
    assert in_second["store"]["identity"] != in_first["store"]["identity"]
    # stage 0's store (length 8) rebuilt with other content: a position in stage 0 is refused, one in stage 1 not
    _, b = two_stores(tmp_path / "c8", 8)
    build(b, stores[8], 8)
    again = _staged(tmp_path, stores)
    again.load_state_dict(in_second)
    again.enter(4)
    assert again.loader.order.cursor == in_second["cursor"]
    again = _staged(tmp_path, stores)
    again.load_state_dict(in_first)
    with pytest.raises(DataError, match="rebuilt with other content"):
        again.enter(2)
    # a position at stage 0's last step: stage 1 starts at its first sample, nothing of stage 0 is read
    at_boundary = {**in_first, "cursor": 4}
    again = _staged(tmp_path, stores)
    again.load_state_dict(at_boundary)
    again.enter(3)
    assert again.stage.index == 1 and again.loader.order.cursor == 0
    # asked for: continues from the same cursor in the new stage-0 store, and says so
    allowed = _staged(tmp_path, stores, allow=True)
    allowed.load_state_dict(in_first)
    allowed.enter(2)
    assert allowed.loader.order.cursor == in_first["cursor"]
    assert "continuing on the new data from the same cursor" in allowed.position_note


def test_a_manifest_with_only_the_required_keys_has_an_identity():
    """A store written by another tool than the builder (tests/distributed/test_packed_docs_edges_audit.py writes
    one) may lack inputs, counts and totals: it still has an identity, which its splits' counts change."""
    from longctx.data.store_identity import store_identity

    def manifest(samples):
        return {"format": "longctx-store", "version": 2, "seq_len": 64, "tokenizer": {"spec": "byte"},
                "parts": [{"dir": "part-00000", "splits": {"train": {"samples": samples, "tokens": 64 * samples}}}]}

    a, b = store_identity(manifest(4)), store_identity(manifest(5))
    assert a["identity"] != b["identity"] and a["inputs"] == [] and a["train_samples"] == 0


LENGTHS = [25, 41, 30, 37, 20, 41, 25, 30, 37, 20, 30, 41, 20, 25, 37, 30, 41, 25, 20, 37, 30, 25, 41, 20]


def packed_in_groups(src, out, group_tokens, monkeypatch):
    """`src` built with packing groups of `group_tokens` tokens (what --max-memory sets: its floor, 1M tokens,
    is more than a test corpus holds, so the property is replaced for the build). With LENGTHS, groups of 192
    and 256 tokens both make 16 samples of 795 tokens, other documents in them."""
    from longctx.data.builder.options import BuildOptions

    if not src.is_dir():
        src.mkdir()
        for i, n in enumerate(LENGTHS):
            (src / f"d{i:02d}.txt").write_text(chr(ord("a") + i) * n)
    with monkeypatch.context() as m:
        m.setattr(BuildOptions, "group_tokens", property(lambda self: group_tokens))
        return PackedSamples(build(src, out))


def test_the_same_documents_packed_in_other_groups_are_told_apart(tmp_path, monkeypatch):
    """Every count agrees (the premise, checked), the samples differ: the identity, which a store built before
    layouts were recorded keeps, is the same; the layout (store.py layout_digest) is not, and a rebuild in the
    same groups gives the same one."""
    import numpy as np

    a = packed_in_groups(tmp_path / "in", tmp_path / "a", 192, monkeypatch)
    b = packed_in_groups(tmp_path / "in", tmp_path / "b", 256, monkeypatch)
    seg_a, seg_b = (np.load(s.root / "part-00000" / "train.segments.npy") for s in (a, b))
    assert (len(a), a.num_tokens) == (len(b), b.num_tokens) and seg_a.shape == seg_b.shape
    assert (seg_a != seg_b).any()
    assert a.identity["identity"] == b.identity["identity"] and a.identity["layout"] != b.identity["layout"]
    assert packed_in_groups(tmp_path / "in", tmp_path / "a2", 192, monkeypatch).identity == a.identity


def test_a_resume_on_the_same_documents_packed_otherwise_is_refused(tmp_path, monkeypatch):
    """A run trained on a store packed in groups of 192 tokens; the store rebuilt in place in groups of 256 (another
    --max-memory): before, the resume read other samples at its cursor without a word. Refused now, naming
    --max-memory; allow_changes continues from the same cursor and says so; a position saved before layouts were
    recorded (none in it) resumes unchecked, as before."""
    packed_in_groups(tmp_path / "in", tmp_path / "s", 192, monkeypatch)
    Trainer(load_config(None, [*BASE, f"--data.path={tmp_path / 's'}", f"--train.run_dir={tmp_path / 'run'}",
                               "--train.steps=2"]), log=quiet).run()
    packed_in_groups(tmp_path / "in", tmp_path / "s", 256, monkeypatch)
    with pytest.raises(DataError, match="packed into other samples") as e:
        resume(tmp_path)
    assert "--max-memory" in str(e.value) and "--checkpoint.allow_changes true" in str(e.value)
    said = []
    trainer = resume(tmp_path, "--checkpoint.allow_changes=true", log=lambda *a, **_: said.append(str(a)))
    assert trainer.sampler.loader.order.cursor == 4
    assert any("packed into other samples" in s and "same cursor" in s for s in said)
    loader = trainer.sampler.loader
    position = saved_position(tmp_path, 2)
    assert position["store"]["layout"] != loader.store["layout"]
    with pytest.raises(DataError, match="packed into other samples"):
        loader.load_state_dict(position)
    del position["store"]["layout"]
    assert loader.load_state_dict(position) is None and loader.order.cursor == 4


def test_a_store_built_before_layouts_were_recorded_keeps_its_identity():
    """A manifest without the splits' layouts (every store built before) has the identity it had then: the
    value below is what the previous release computed for it (9eb79eb), so its checkpoints still resume."""
    from longctx.data.store_identity import store_identity

    manifest = {"format": "longctx-store", "version": 2, "seq_len": 64, "tokenizer": {"spec": "byte"},
                "parts": [{"dir": "part-00000", "splits": {"train": {"samples": 4, "tokens": 256}}}]}
    assert store_identity(manifest) == {"identity": "80ad62ff4191d767", "inputs": [], "documents": 0, "tokens": 0,
                                        "train_samples": 0}
