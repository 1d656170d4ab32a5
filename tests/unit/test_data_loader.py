"""Reading packed samples for training: labels, positions, document ids, padding; the global
cursor across data-parallel degrees; cost balancing; training from a store."""

import random

import numpy as np
import pytest

from longctx.config import load_config
from longctx.data.balance import balanced_order, imbalance, karmarkar_karp
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import BatchLoader, PackedSamples
from longctx.data.samples import IGNORE
from longctx.errors import ConfigError, DataError


def quiet(*_):
    pass


def corpus(d, lengths, seed=0):
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i, n in enumerate(lengths):
        (d / f"d{i:03d}.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(n)))
    return d


@pytest.fixture
def small_store(tmp_path):
    # documents of 5, 3 and 9 bytes (+ EOS): bfd in samples of 12 -> [10], [6, 4]
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text("hello")
    (d / "b.txt").write_text("abc")
    (d / "c.txt").write_text("xyzxyzxyz")
    build_store(BuildOptions([str(d)], str(tmp_path / "s"), 12, strategy="bfd", dedup="none", workers=1,
                             progress=False, stats=False), log=quiet)
    return tmp_path / "s"


def test_packed_sample_labels_positions_doc_ids_and_padding(small_store):
    w = PackedSamples(small_store)
    assert len(w) == 2
    eos = 257
    rows = {tuple(w.batch([i]).tokens[0].tolist()): i for i in range(2)}
    one = [i for t, i in rows.items() if t[:10] == tuple(b"xyzxyzxyz") + (eos,)][0]
    b = w.batch([one])
    assert b.tokens[0, :10].tolist() == list(b"xyzxyzxyz") + [eos]
    # the EOS ends the document: nothing to predict after it in this sample; padding predicts nothing
    assert b.labels[0].tolist() == list(b"yzxyzxyz") + [eos] + [IGNORE] * 3
    assert b.positions[0].tolist() == list(range(10)) + [0, 1]
    assert b.doc_ids[0].tolist() == [0] * 10 + [1, 1]  # padding in a document of its own
    two = 1 - one
    b = w.batch([two])
    assert b.doc_ids[0].tolist() == [0] * 6 + [1] * 4 + [2] * 2
    assert b.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]
    assert b.labels[0].tolist() == list(b"ello") + [eos, IGNORE] + list(b"bc") + [eos, IGNORE, IGNORE, IGNORE]
    assert b.valid_tokens == 5 + 3


def test_without_document_masks_labels_cross_documents_but_not_padding(small_store):
    w = PackedSamples(small_store, doc_mask=False)
    for i in range(len(w)):
        b = w.batch([i])
        real = int(w.real_tokens[i])
        t = b.tokens[0].tolist()
        assert b.labels[0].tolist() == t[1:real] + [IGNORE] * (12 - real + 1)
        assert b.positions[0].tolist() == list(range(12)) and b.doc_ids is None


def test_karmarkar_karp_balances_equal_size_groups():
    rng = np.random.default_rng(0)
    costs = rng.pareto(1.5, size=64) + 1
    groups = karmarkar_karp(costs, 4)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert all(len(g) == 16 for g in groups)
    sums = [costs[g].sum() for g in groups]
    naive = [costs[i * 16:(i + 1) * 16].sum() for i in range(4)]
    assert max(sums) / np.mean(sums) < max(naive) / np.mean(naive)
    # no split does better: the mean, or the heaviest item with the 15 lightest others
    lower_bound = max(np.mean(sums), costs.max() + np.sort(costs)[:15].sum())
    assert max(sums) <= 1.05 * lower_bound
    # a case with a known optimum: 8 items into 2 groups of 4 with equal sums
    groups = karmarkar_karp([8, 7, 6, 5, 4, 3, 2, 1], 2)
    assert sorted(sum([8, 7, 6, 5, 4, 3, 2, 1][i] for i in g) for g in groups) == [18, 18]


def test_balanced_order_is_a_permutation_that_lowers_imbalance():
    costs = np.array([100.0, 1, 1, 1, 90, 2, 2, 2])
    idx = [0, 4, 1, 2, 3, 5, 6, 7]  # naive: rank 0 gets 0 and 4 (190) rank 1 ...
    out = balanced_order(idx, costs, 4)
    assert sorted(out) == sorted(idx)
    assert imbalance(out, costs, 4) < imbalance(idx, costs, 4)
    assert balanced_order(idx, costs, 1) == idx


def test_resume_under_another_dp_degree_sees_exactly_the_unseen_samples(tmp_path):
    build_store(BuildOptions([str(corpus(tmp_path / "in", [random.Random(i).randint(5, 300) for i in range(60)]))],
                             str(tmp_path / "s"), 64, strategy="bfd", dedup="none", workers=1, progress=False,
                             stats=False), log=quiet)
    samples = PackedSamples(tmp_path / "s")
    n = len(samples)
    assert n >= 40
    batch = 8
    a = BatchLoader(samples, batch, seed=3, dp=2)
    seen = []
    for _ in range(3):
        idx = a.next_indices()
        seen += idx
    state = a.state_dict()
    b = BatchLoader(samples, batch, seed=3, dp=4)  # resumed with twice the data-parallel ranks
    b.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < n - n % batch:
        rest += b.next_indices()
    # within the epoch, no sample twice, and none skipped
    assert len(set(seen + rest)) == len(seen + rest) == n - n % batch
    # each global batch is the one an uninterrupted single-rank run draws (the order inside a
    # batch may differ: that is the cost balancing over ranks)
    ref = BatchLoader(samples, batch, seed=3, dp=1)
    ref_all = [i for _ in range((len(seen) + len(rest)) // batch) for i in ref.next_indices()]
    for k in range(0, len(ref_all), batch):
        assert sorted((seen + rest)[k:k + batch]) == sorted(ref_all[k:k + batch])
    # rank r of the resumed job takes rows [r * 2, r * 2 + 2) of each batch: together all of them
    per_rank = [[i for k in range(0, len(rest), batch) for i in rest[k + 2 * r:k + 2 * r + 2]] for r in range(4)]
    assert sorted(sum(per_rank, [])) == sorted(rest)
    # and the balanced order spreads the cost over the 4 ranks at least as evenly as the drawn order
    from longctx.data.balance import imbalance

    costs = samples.costs(1.0, 0.0)
    start = len(seen)  # rest begins at a batch boundary
    drawn = [ref_all[k:k + batch] for k in range(start, len(ref_all), batch)]
    balanced = [rest[k:k + batch] for k in range(0, len(rest), batch)]
    assert sum(imbalance(i, costs, 4) for i in balanced) <= sum(imbalance(i, costs, 4) for i in drawn)


def test_loader_refuses_a_position_from_other_data(small_store):
    w = PackedSamples(small_store)
    loader = BatchLoader(w, 2, seed=0)
    with pytest.raises(DataError, match="training samples"):
        loader.load_state_dict({"cursor": 4, "seed": 0, "num_samples": 999})
    loader.load_state_dict({"cursor": 1, "seed": 0, "num_samples": len(w)})
    assert loader.state_dict() == {"cursor": 1, "seed": 0, "num_samples": len(w), "store": w.identity}


def cfg_for(tmp_path, *extra):
    return load_config(overrides=[
        f"--train.run_dir={tmp_path / 'run'}", "--train.steps=6", "--train.seq_len=64", "--train.global_batch=4",
        "--train.warmup_steps=1", "--train.eval_interval=3", "--train.eval_batches=1", "--metrics.log_interval=3",
        "--metrics.progress=false", "--metrics.plots=false", "--model.layers=1", *extra,
    ])


def test_training_from_a_store_uses_document_masks(tmp_path, monkeypatch):
    import longctx.train.step_run as step_run  # (the step's forward: train/step_run.py)
    import longctx.train.trainer as t

    src = corpus(tmp_path / "in", [random.Random(i).randint(10, 200) for i in range(80)])
    build_store(BuildOptions([str(src)], str(tmp_path / "s"), 64, strategy="bfd", dedup="minhash", workers=1,
                             eval_fraction=0.2, progress=False), log=quiet)
    seen = []
    real = step_run.forward_loss_sum

    def spy(model, batch, autocast_dtype):
        seen.append(batch)
        return real(model, batch, autocast_dtype)

    monkeypatch.setattr(step_run, "forward_loss_sum", spy)
    res = t.train(cfg_for(tmp_path, f"--data.path={tmp_path / 's'}"), log=quiet)
    assert len(res.losses) == 6 and all(np.isfinite(res.losses)) and set(res.eval_losses) == {3, 6}
    assert all(b.doc_ids is not None for b in seen)
    assert max(int(b.doc_ids.max()) for b in seen) >= 2  # packed samples: several documents each
    # the batches are the store's samples
    store = PackedSamples(tmp_path / "s")
    train_rows = {tuple(store.batch([i]).tokens[0].tolist()) for i in range(len(store))}
    assert all(tuple(row.tolist()) in train_rows for row in seen[0].tokens)


def test_store_mismatches_are_config_errors(tmp_path):
    src = corpus(tmp_path / "in", [100] * 30)
    build_store(BuildOptions([str(src)], str(tmp_path / "s"), 64, workers=1, progress=False, stats=False), log=quiet)
    from longctx.train.setup import build_data

    with pytest.raises(ConfigError, match="samples of 64 tokens but train.seq_len is 128"):
        build_data(cfg_for(tmp_path, f"--data.path={tmp_path / 's'}", "--train.seq_len=128"), log=quiet)
    with pytest.raises(ConfigError, match="has 258 tokens but model.vocab_size is 200"):
        build_data(cfg_for(tmp_path, f"--data.path={tmp_path / 's'}", "--model.vocab_size=200"), log=quiet)
    with pytest.raises(DataError, match="not a longctx data store"):
        build_data(cfg_for(tmp_path, f"--data.path={tmp_path}"), log=quiet)
    with pytest.raises(ConfigError, match="both set"):
        cfg_for(tmp_path, f"--data.path={tmp_path / 's'}", f"--data.corpus={src}")


def test_default_store_is_built_once_and_reused(tmp_path, monkeypatch):
    import longctx.data.default_store as cache

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    src = corpus(tmp_path / "in", [random.Random(i).randint(10, 300) for i in range(50)])
    cfg = cfg_for(tmp_path, f"--data.corpus={src}", "--data.eval_fraction=0.1")
    calls = []
    real = cache.build_store
    monkeypatch.setattr(cache, "build_store", lambda *a, **k: calls.append(1) or real(*a, **k))
    from longctx.train.setup import build_data

    w1, _ = build_data(cfg, log=quiet)
    w2, _ = build_data(cfg, log=quiet)
    assert len(calls) == 1 and w1.root == w2.root and str(w1.root).startswith(str(tmp_path / "cache"))
    assert "concat" in w1.root.name  # seq_len 64 < 2048: strategy auto = concat
    build_data(cfg_for(tmp_path, f"--data.corpus={src}", "--data.eval_fraction=0.1", "--data.strategy=bfd"),
                 log=quiet)
    assert len(calls) == 2  # other settings, another store
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 2  # no temporary leftovers


def test_resume_with_another_seed_is_refused():
    """The saved cursor only means something under the seed that drew the order."""
    from longctx.data.samples import SampleOrder

    state = SampleOrder(100, seed=1).state_dict()
    loader = BatchLoader.__new__(BatchLoader)  # only its order and sample count matter here
    loader.order, loader.samples = SampleOrder(100, seed=2), np.zeros(100)
    with pytest.raises(DataError, match="seed 1"):
        loader.load_state_dict(state)
