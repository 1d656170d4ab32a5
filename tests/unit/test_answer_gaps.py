"""Documents trained on several spans (a conversation's answers, `data build --messages-field`): training
starts at store.LOSS_FROM and stops and starts again at each offset of store.LOSS_GAPS. TrainedSpans
(data/trained_spans.py) answers both of the loader's questions, per token and per range, and is checked
here against a token-by-token reading; the loader then labels only the answers' tokens, with and without
document masks, also where a document is cut across samples, and label_count agrees with the labels.
(test_conversations.py builds such stores from real conversations; here the gaps are written by hand into
a store of long plain documents, so that they fall across sample boundaries.)"""

import numpy as np
import pytest
from test_instruction_pairs import _targets, long_plain_store

from longctx.data.builder import spill
from longctx.data.loader import PackedSamples
from longctx.data.store import LOSS_FROM, LOSS_GAPS, read_manifest, write_manifest
from longctx.data.trained_spans import TrainedSpans
from longctx.errors import DataError


def _switches(rng, length, gaps):
    """A first trained token in [1, length) and up to `gaps` (off, on) pairs after it, increasing."""
    first = int(rng.integers(1, length))
    after = np.sort(rng.choice(np.arange(first + 1, length), size=min(2 * gaps, length - first - 1), replace=False))
    return first, after[:len(after) // 2 * 2]


def _by_token(length, first, gaps):
    """[length + 1] bool, token by token: trained where an odd number of switches lie at or before it."""
    switches = [first, *gaps.tolist()]
    return np.array([sum(s <= t for s in switches) % 2 == 1 for t in range(length + 1)])


def test_trained_spans_agree_with_a_token_by_token_reading():
    rng = np.random.default_rng(0)
    for trial in range(200):
        lengths = rng.integers(2, 50, rng.integers(1, 7))
        drawn = [_switches(rng, int(n), int(rng.integers(0, 4)) if trial % 4 else 0) for n in lengths]
        offsets = np.concatenate([[0], np.cumsum([len(g) for _, g in drawn])])
        spans = TrainedSpans(np.array([f for f, _ in drawn]), offsets, np.concatenate([g for _, g in drawn]))
        trained = [_by_token(int(n), f, g) for n, (f, g) in zip(lengths, drawn)]
        docs = np.concatenate([np.full(n + 1, d) for d, n in enumerate(lengths)])
        at = np.concatenate([np.arange(n + 1) for n in lengths])
        order = rng.permutation(len(docs))  # (queries in any order, documents mixed)
        assert np.array_equal(spans.trained(docs[order], at[order]), np.concatenate(trained)[order])
        before = np.concatenate([np.concatenate([[0], np.cumsum(t)[:-1]]) for t in trained])
        assert np.array_equal(spans.before(docs[order], at[order]), before[order])
    assert TrainedSpans(np.array([3])).before([0, 0], [2, 9]).tolist() == [0, 6]  # (no gaps: one formula)


def _gapped_store(tmp_path):
    """A concat store of long plain documents (cut across samples of 64), each given a first trained token
    and gaps by hand, and its manifest their counts; (root, documents, their [tokens] trained masks)."""
    root, docs = long_plain_store(tmp_path)
    rng = np.random.default_rng(1)
    drawn = [_switches(rng, len(docs[d]), 3) for d in range(len(docs))]
    np.save(root / "part-00000" / LOSS_FROM, np.array([f for f, _ in drawn], dtype=np.int64))
    gaps = spill.RaggedWriter(root / "part-00000" / LOSS_GAPS, np.int64)
    for _, g in drawn:
        gaps.append(g)
    gaps.close()
    manifest = read_manifest(root)
    manifest["version"] = 4
    manifest["parts"][0]["counts"].update(response_only_documents=len(docs), answer_gap_documents=len(docs))
    write_manifest(root, manifest)
    return root, docs, {d: _by_token(len(docs[d]), *drawn[d])[:-1] for d in docs}


@pytest.mark.parametrize("doc_mask", [True, False])
def test_only_the_answers_are_labelled_where_documents_are_cut_across_samples(tmp_path, doc_mask):
    root, docs, trained = _gapped_store(tmp_path)
    samples = PackedSamples(root, "train", doc_mask=doc_mask)
    segments = [samples.segments(i).tolist() for i in range(len(samples))]
    starts = {(doc, start) for segs in segments for _, _, _, doc, start in segs}
    found, counts = _targets(samples)  # (label_count checked against each sample's labels there)
    # a piece's first token is no target with document masks (its context is in another sample); without
    # them it is, but for a sample's very first token
    skip = starts if doc_mask else {(segs[0][3], segs[0][4]) for segs in segments}
    expected = {(d, j) for d in docs for j in np.flatnonzero(trained[d]).tolist() if (d, j) not in skip}
    assert len(samples) > len(docs) and found == expected
    assert any((~t[int(t.argmax()):]).any() for t in trained.values())  # (a gap after a first answer)
    assert sum(counts) == len(expected)
    indices = list(range(min(4, len(samples))))  # a sequence-parallel rank's share: the same labels there
    whole, frames = samples.batch(indices), samples.frames(indices)
    held = np.stack([np.sort(np.random.default_rng(i).choice(64, 16, replace=False)) for i in indices])
    part = samples.read_at(indices, frames, held)
    assert np.array_equal(part.labels.numpy(), np.take_along_axis(whole.labels.numpy(), held, 1))


@pytest.mark.parametrize("damage", ["missing", "shorter"])
def test_a_part_whose_gaps_are_missing_or_of_another_length_is_refused(tmp_path, damage):
    """A part copied without its gaps file would train on the user turns between the answers."""
    root, docs, _ = _gapped_store(tmp_path)
    offsets = root / "part-00000" / f"{LOSS_GAPS}.offsets.npy"
    if damage == "missing":
        offsets.unlink()
        (root / "part-00000" / f"{LOSS_GAPS}.bin").unlink()
    else:
        np.save(offsets, np.load(offsets)[:-1])
    found = "is missing" if damage == "missing" else f"holds {len(docs) - 1} documents"
    with pytest.raises(DataError, match=f"is damaged: .*{LOSS_GAPS}.offsets.npy {found}, its manifest {len(docs)} "
                                        f"\\({len(docs)} trained on several answers\\); rebuild it"):
        PackedSamples(root, "train")


def test_the_trained_token_mask_of_a_part_is_the_loaders_reading(tmp_path):
    """data.loader.trained_token_mask (what the GliDe draft's vocabulary counts, train/glide.py token_counts):
    per sample, the tokens whose document trains on them, in any block of samples."""
    from longctx.data.store import load_split
    from longctx.data.trained_spans import part_trained_spans, trained_token_mask

    root, docs, trained = _gapped_store(tmp_path)
    samples, part = PackedSamples(root, "train"), read_manifest(root)["parts"][0]
    arrays = load_split(root, part, "train")
    for lo, hi in ((0, len(samples)), (1, 3), (len(samples) - 2, len(samples) + 5)):
        mask = trained_token_mask(part_trained_spans(root, part), part, arrays, lo, hi)
        assert mask.shape == (min(hi, len(samples)) - lo, 64)
        for i in range(lo, min(hi, len(samples))):
            want = np.zeros(64, dtype=bool)
            for _, offset, length, doc, start in samples.segments(i).tolist():
                want[offset:offset + length] = trained[doc][start:start + length]
            assert np.array_equal(mask[i - lo], want)


def test_eval_ppl_on_instruction_data_scores_its_answers_only(tmp_path):
    """`longctx eval --task ppl --data STORE` (eval/tasks.py): a span's token predicts the next only where
    that one is trained on, as training's loss scores it; a plain store's spans are scored whole."""
    from longctx.data.samples import IGNORE
    from longctx.eval.tasks import load_source, ppl_sequences

    root, docs, trained = _gapped_store(tmp_path)
    source = load_source(str(root), "train", None, None)
    assert "ppl scores their answers" in source.description
    sequences = ppl_sequences(source, 64, 1000)
    want = []
    for d in sorted(docs):
        for start in range(0, len(docs[d]) - 63, 64):
            scored = trained[d][start + 1:start + 64]
            if scored.any():
                want.append((docs[d][start:start + 64], np.append(scored, False)))
    assert len(sequences) == len(want) > 0
    for seq, (tokens, scored) in zip(sequences, want):
        assert seq.tokens.tolist() == tokens and np.array_equal(seq.labels != IGNORE, scored)
    assert sum(int((s.labels != IGNORE).sum()) for s in sequences) < 63 * len(sequences)  # (prompts left out)


def test_a_mix_says_each_stores_share_of_the_tokens_trained_on(tmp_path):
    """data.weights are shares of samples; a store of instruction data trains on its answers only, so its share
    of the loss is smaller than its weight: the mix's setup line says it (store_mix.mix_line)."""
    from test_instruction_pairs import PAIRS, _build, _jsonl

    from longctx.data.store_mix import StoreMix, mix_line

    pairs, _ = _build(tmp_path, [_jsonl(tmp_path / "p.jsonl", PAIRS)], eval_fraction=0.0, name="pairs")
    plain, _ = _build(tmp_path, [_jsonl(tmp_path / "t.jsonl", [(p + r, "") for p, r in PAIRS], response="x")],
                      eval_fraction=0.0, name="plain", response_field="", text_field="prompt")
    stores = [PackedSamples(pairs, "train"), PackedSamples(plain, "train")]
    mix = StoreMix(stores, [str(pairs), str(plain)], [0.5, 0.5], seed=0)
    share = np.mean(stores[0].label_counts) / (np.mean(stores[0].label_counts) + np.mean(stores[1].label_counts))
    line = mix_line(mix, 100)
    assert share < 0.4 and "pairs 50% (" in line and f"{share:.0%} of the tokens trained on" in line
