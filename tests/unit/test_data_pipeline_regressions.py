"""Regressions from an audit of the training data pipeline for silent wrong results.

- concat packing of a long document whose pieces went to both splits: its consecutive train pieces
  are one run of text, cut only where samples end (they were separate segments inside a sample: a
  document boundary, positions restarting and a label lost in the middle of running text);
- a tokenizer.json whose ids are not dense (largest id >= its token count): ids past 65535 were stored
  as uint16 and silently wrapped;
- a synthetic mixture (data.synthetic) read its samples without the padding mask (Batch.real None), so
  MoE layers counted the padding of its ordinary samples in their router statistics and capacity;
- the eval split at several lengths: pieces of long documents held out at each store's own seq_len differ
  between lengths (75% of a 512-token store's eval tokens were a 128-token store's training tokens);
  --holdout-tokens gives them one grid; a staged run's stores (and the ones its preflight checks, which
  are the same) use its longest stage's; a few long documents do not lose a whole one to the eval
  split when the grid is longer than a sample (the fallback holds out a sample-sized part);
- datasculpt's clustering features of Chinese / Japanese / Thai text: a clause without spaces was one
  "word", so two sentences on one topic shared no feature; now each character is a word, its bigrams
  the features (as the dedup shingles already read such text);
- the sample order at epoch boundaries: every epoch is each sample exactly once, whatever the batch,
  grad_accum, read ahead, dp degree or the step a run resumes at (a batch that straddles two epochs may
  hold one sample twice, once for each epoch: that is not a repeat within an epoch).
"""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_stages import _Samples  # (n samples; sample i is all i)
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.data.store import read_manifest
from longctx.data.synthetic import SyntheticMixture
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import DataError
from longctx.train.stages import StagedLoader


def quiet(*_):
    pass


def build(tmp_path, texts: dict, **kw):
    src = tmp_path / "in"
    src.mkdir()
    for name, text in texts.items():
        (src / name).write_text(text)
    kw = {"seq_len": 128, "strategy": "concat", "dedup": "none", "workers": 1, "stats": False, "progress": False,
          **kw}
    out = tmp_path / "store"
    build_store(BuildOptions(inputs=[str(src)], out=str(out), **kw), log=quiet)
    return out


def part_arrays(root, split):
    m = read_manifest(root)
    d = root / m["parts"][0]["dir"]
    docs = [json.loads(line) for line in open(d / "docs.jsonl")]
    return m, docs, np.load(d / f"{split}.tokens.npy"), np.load(d / f"{split}.segments.npy")


def long_text(rng, lines):
    return "\n".join(" ".join(f"w{rng.randrange(500)}" for _ in range(rng.randint(1, 8))) for _ in range(lines))


def test_concat_cuts_a_long_documents_train_text_only_where_samples_end(tmp_path):
    rng = random.Random(0)
    texts = {f"book{i:02d}.txt": long_text(rng, 60) for i in range(6)}
    root = build(tmp_path, texts, eval_fraction=0.3, holdout_tokens=128)  # (held out in pieces of a sample)
    m, docs, tokens, segs = part_arrays(root, "train")
    assert any(d["split"] == "both" for d in docs)  # the case: a document with pieces in each split
    L = m["seq_len"]
    # reference, from the document text the store keeps for training: each document's train tokens as
    # maximal runs [a, b), the runs concatenated in document order and cut every seq_len tokens
    intervals: dict[int, list] = {}
    for _, _, n, doc, start in segs.tolist():
        intervals.setdefault(doc, []).append([start, start + n])
    runs = []
    for doc in sorted(intervals):
        for a, b in sorted(intervals[doc]):
            if runs and runs[-1][0] == doc and runs[-1][2] == a:
                runs[-1][2] = b
            else:
                runs.append([doc, a, b])
    expected, at = [], 0
    for doc, a, b in runs:
        while a < b:
            take = min(b - a, L - at % L)
            expected.append((at // L, at % L, take, doc, a))
            a, at = a + take, at + take
    assert [tuple(s) for s in segs.tolist()] == expected
    # and the loader's labels: every token of a run but the last in its sample has one
    samples = PackedSamples(root)
    assert samples.label_count(range(len(samples))) == sum(n - 1 for _, _, n, _, _ in expected)
    batch = samples.batch(range(len(samples)))
    for s, off, n, _, _ in expected:
        assert batch.labels[s, off:off + n - 1].tolist() == tokens[s, off + 1:off + n].tolist()
        assert batch.positions[s, off:off + n].tolist() == list(range(n))


def test_bfd_keeps_its_pieces_when_consecutive_train_pieces_are_one_item(tmp_path):
    """bfd (and datasculpt) cut a run of consecutive train pieces again at the same cut points: the
    pieces of both splits are exactly those of the same corpus built with no eval split."""
    rng = random.Random(0)
    texts = {f"book{i:02d}.txt": long_text(rng, 60) for i in range(6)}
    (tmp_path / "split").mkdir()
    (tmp_path / "whole").mkdir()
    root = build(tmp_path / "split", texts, eval_fraction=0.3, strategy="bfd", holdout_tokens=128)

    def pieces(root, splits):
        out = set()
        for split in splits:
            _, docs, _, segs = part_arrays(root, split)
            out |= {(docs[doc]["name"], start, n) for _, _, n, doc, start in segs.tolist()}
        return out

    _, docs, _, _ = part_arrays(root, "train")
    assert any(d["split"] == "both" for d in docs)
    whole = build(tmp_path / "whole", texts, eval_fraction=0.0, strategy="bfd")
    assert pieces(root, ("train", "eval")) == pieces(whole, ("train",))


def test_a_tokenizer_with_ids_past_its_token_count_stores_them_unwrapped(tmp_path):
    vocab = {"<unk>": 0, "alpha": 1, "beta": 2, "</s>": 3, "gamma": 70000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    root = build(tmp_path, {"a.txt": "alpha beta gamma", "b.txt": "gamma gamma alpha"}, tokenizer=str(path),
                 seq_len=16)
    m, docs, tokens, segs = part_arrays(root, "train")
    stored = {}
    for s, off, n, doc, _ in segs.tolist():
        stored[docs[doc]["name"]] = tokens[s, off:off + n].tolist()
    assert stored == {"a.txt": [1, 2, 70000, 3], "b.txt": [70000, 70000, 1, 3]}  # (not 70000 % 65536 = 4464)
    assert m["tokenizer"]["vocab_size"] == 70001


def test_a_synthetic_mixture_marks_the_padding_of_its_ordinary_samples(tmp_path):
    rng = random.Random(1)
    texts = {f"d{i:02d}.txt": " ".join(f"w{rng.randrange(99)}" for _ in range(rng.randint(3, 40))) for i in range(30)}
    root = build(tmp_path, texts, strategy="bfd", seq_len=256)
    store = PackedSamples(root)
    mixture = SyntheticMixture(store, "passkey", 0.5, seed=0, tokenizer=ByteTokenizer())
    rows = list(range(len(store)))
    assert mixture.synthetic.any() and not mixture.synthetic.all()
    assert (store.real_tokens[~mixture.synthetic] < store.seq_len).any()  # ordinary samples with padding
    got = mixture.batch(rows).real
    assert got is not None
    expected = store.batch(rows).real.clone()  # the store's own mask (from its segment index)
    expected[torch.from_numpy(mixture.synthetic)] = True  # a retrieval sequence is all text
    assert torch.equal(got, expected)


def _staged(n, grad_accum, read_ahead, dp=1):
    cfg = load_config(None, ["--train.stages=8:40", "--train.eval_interval=0", "--train.global_batch=4",
                             f"--train.grad_accum={grad_accum}"])
    return StagedLoader(cfg, lambda c: (_Samples(n, c.train.seq_len), None), dp=dp, read_ahead=read_ahead)


def _run(loader, steps):
    out = []
    for step in steps:
        loader.enter(step)
        out += [i for b, _ in loader.step_batches(step) for i in b.tokens[:, 0].tolist()]
    return out


@pytest.mark.parametrize("n", [7, 10])  # batches straddle every epoch boundary, or some of them
def test_every_epoch_is_each_sample_once_across_resumes_at_any_step(n):
    steps = 10
    reference = _run(_staged(n, 1, False), range(1, steps + 1))
    for e in range(len(reference) // n):
        assert sorted(reference[e * n:(e + 1) * n]) == list(range(n))
    for cut in range(1, steps):
        first = _staged(n, 2, True)
        seen = _run(first, range(1, cut + 1))
        state = first.state_dict()
        first.close()
        resumed = _staged(n, 4, False, dp=2)  # other grad_accum, no read ahead, other dp degree
        resumed.load_state_dict(state)
        rest = _run(resumed, range(cut + 1, steps + 1))
        assert seen + rest == reference


def held_out_text(root) -> dict:
    """Per document name, the eval split's token intervals [a, b), merged."""
    m, docs, _, segs = part_arrays(root, "eval")
    found: dict = {}
    for _, _, n, doc, start in segs.tolist():
        found.setdefault(docs[doc]["name"], []).append([start, start + n])
    out = {}
    for name, spans in found.items():
        merged = []
        for a, b in sorted(spans):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        out[name] = merged
    return out


def overlap(a: dict, b: dict) -> int:
    """Tokens held out in `a` that `b` does not hold out (so trains on)."""
    total = 0
    for name, spans in a.items():
        other = b.get(name, [])
        for x, y in spans:
            total += (y - x) - sum(max(0, min(y, q) - max(x, p)) for p, q in other)
    return total


def test_stores_at_two_lengths_hold_out_the_same_text_on_one_grid(tmp_path):
    """Pieces held out at each store's own seq_len differ between lengths: most of one length's eval text
    is the other's training text. On one grid (the default, or one --holdout-tokens) they hold out the same."""
    rng = random.Random(1)
    texts = {f"book{i:02d}.txt": long_text(rng, 120) for i in range(8)}
    for name in ("own128", "own512", "given128", "given512"):
        (tmp_path / name).mkdir()

    def held(name, n, **kw):
        return held_out_text(build(tmp_path / f"{name}{n}", texts, seq_len=n, strategy="bfd", eval_fraction=0.2,
                                   **kw))

    own = {n: held("own", n) for n in (128, 512)}  # each on its own seq_len's grid (the default)
    assert overlap(own[512], own[128]) > 0.5 * sum(b - a for s in own[512].values() for a, b in s)
    given = {n: held("given", n, holdout_tokens=512) for n in (128, 512)}
    assert given[128] == given[512] == own[512] and given[128]
    with pytest.raises(DataError, match="built with holdout_tokens 512.*pass --holdout-tokens 512"):
        build_store(BuildOptions(inputs=[str(tmp_path / "own128" / "in")], out=str(tmp_path / "given128" / "store"),
                                 seq_len=128, strategy="bfd", dedup="none", eval_fraction=0.2, append=True,
                                 stats=False, progress=False), log=quiet)


def test_every_stage_and_preflight_read_one_store_per_length_on_one_grid(tmp_path, monkeypatch):
    from longctx.train.preflight import _check_data
    from longctx.train.setup import store_path
    from longctx.train.stages import stage_config, stages_of

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    rng = random.Random(2)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"book{i:02d}.txt").write_text(long_text(rng, 120))
    cfg = load_config(overrides=[f"--data.corpus={corpus}", "--data.eval_fraction=0.2", "--data.strategy=bfd",
                                 "--data.dedup=none", "--train.stages=128:2,512:2"])
    for stage in stages_of(cfg):
        _check_data(stage_config(cfg, stage), quiet)  # preflight builds the stores the run then reads
    stores = [store_path(stage_config(cfg, stage), quiet, None) for stage in stages_of(cfg)]
    assert sorted(p.parent.name for p in (tmp_path / "cache").rglob("manifest.json")) == sorted(
        Path(s).name for s in stores)
    first, second = (held_out_text(Path(s)) for s in stores)
    assert first == second and overlap(second, first) == 0 and first


def test_features_of_unspaced_scripts_are_characters_and_their_bigrams():
    from longctx.data.builder.features import _WORD, head_features

    def shared(a, b):
        return len(np.intersect1d(head_features(a)[0], head_features(b)[0]))

    weather, weather2 = "今天天气很好，我们去公园散步吧。", "今天天气不错，我们去公园走走。"
    training = "机器学习模型需要大量数据进行训练。"
    assert shared(weather, weather2) >= 10 > 2 >= shared(weather, training)  # (was 0 and 0)
    # text in spaced scripts keeps its features: runs of 2+ word characters and their bigrams
    english = "The quick brown fox jumps over the lazy dog; a fox is quick."
    assert _WORD.findall(english.lower())[:3] == ["the", "quick", "brown"]
    assert len(head_features(english)[0]) == len(set(_WORD.findall(english.lower()))) + 12 - 1  # words + bigrams


def test_with_a_grid_longer_than_a_sample_the_fallback_holds_out_a_sample_sized_part(tmp_path):
    """No piece hashed into the eval split: the lowest-hash one's sample-sized part is held out, not a
    whole grid piece (here a whole book: a quarter of the corpus)."""
    rng = random.Random(4)
    texts = {f"book{i:02d}.txt": long_text(rng, 120) for i in range(4)}
    lines = []
    src = tmp_path / "in"
    src.mkdir()
    for name, text in texts.items():
        (src / name).write_text(text)
    m = build_store(BuildOptions(inputs=[str(src)], out=str(tmp_path / "store"), seq_len=128, strategy="bfd",
                                 dedup="none", eval_fraction=1e-6, holdout_tokens=1 << 14, workers=1, stats=False,
                                 progress=False), log=lines.append)
    held = held_out_text(tmp_path / "store")
    assert sum(b - a for spans in held.values() for a, b in spans) <= 128 and len(held) == 1
    assert m["totals"]["eval_samples"] == 1 and any("a sample-sized part of it" in line for line in lines)


def test_eval_and_bench_decode_read_the_default_corpus_on_the_models_training_grid(tmp_path, monkeypatch):
    """`longctx eval` / `bench decode` without --data evaluate on the default corpus's store at 1024
    tokens: held out on the grid the checkpoint's own training store used (its manifest's
    trained_positions), not on 1024's, so none of its text is what the model trained on."""
    from types import SimpleNamespace

    from longctx.bench import decode
    from longctx.data import default_store as stores
    from longctx.data.default_store import trained_grid
    from longctx.eval import inputs

    step = tmp_path / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"trained_positions": 4096}))
    assert trained_grid(str(step)) == 4096
    assert trained_grid("hf:/nowhere") == trained_grid(str(tmp_path / "none")) == 0
    asked = []
    monkeypatch.setattr(stores, "default_store", lambda *a, **k: asked.append(k["holdout_tokens"]) or "x")
    monkeypatch.setattr("longctx.eval.tasks.load_source", lambda data, split, tok, store, prefix=(): store())
    with pytest.raises(AttributeError):  # (after the store: the stand-in source has no meta)
        inputs._load_source(SimpleNamespace(data="", split="eval", checkpoint=str(step)), None, "byte", None)
    with pytest.raises(AttributeError):  # (after the store)
        decode._prompts(SimpleNamespace(prompts="", data="", lengths="16", samples=1, target=str(step)),
                        ByteTokenizer(), "byte")
    assert asked == [4096, 4096]


def test_eval_reads_a_documents_held_out_pieces_as_separate_runs(tmp_path):
    """eval/tasks.py store_documents: a document whose pieces went to both splits is read as its runs of
    eval text, each a contiguous part of the document (it glued non-adjacent pieces into one, so a span
    crossed the training text between them)."""
    from longctx.eval.tasks import store_documents

    rng = random.Random(5)
    texts = {f"book{i:02d}.txt": long_text(rng, 120) for i in range(6)}
    (tmp_path / "split").mkdir()
    (tmp_path / "whole").mkdir()
    split = build(tmp_path / "split", texts, eval_fraction=0.3, strategy="bfd", holdout_tokens=128)
    whole = [bytes(d.astype(np.uint8)) for d in store_documents(build(tmp_path / "whole", texts, strategy="bfd"),
                                                                  "train")]
    runs = [bytes(r.astype(np.uint8)) for r in store_documents(split, "eval")]
    _, docs, _, _ = part_arrays(split, "eval")
    held = {d["name"] for d in docs if d["split"] != "train"}
    assert any(d["split"] == "both" for d in docs) and len(runs) > len(held)
    assert all(any(r in doc for doc in whole) for r in runs)


def test_a_staged_runs_early_checkpoint_names_the_grid_its_stores_hold_out_on(tmp_path):
    """Checkpoints record the grid of the default-corpus stores their run read (the longest stage's), so
    `longctx eval` of a checkpoint saved before that stage reads the corpus on it: its trained_positions
    (the stage so far) would name another grid."""
    from longctx.data.default_store import trained_grid
    from longctx.train.trainer import Trainer

    cfg = load_config(None, ["--train.stages=64:2,128:2", "--train.global_batch=2", "--data.max_docs=40",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--checkpoint.interval=2", f"--train.run_dir={tmp_path}"])
    Trainer(cfg, log=quiet).run()
    early = tmp_path / "checkpoints" / "step-00000002"
    manifest = json.loads((early / "manifest.json").read_text())
    assert manifest["trained_positions"] == 64 and manifest["holdout_tokens"] == 128
    assert trained_grid(str(early)) == 128 == trained_grid(str(tmp_path / "checkpoints"))
