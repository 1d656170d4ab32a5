"""Weighted mixtures of stores (data.path = "a,b,c", data.weights; data/store_mix.py): the blend keeps every
prefix within one sample of its weights, is the same under a seed, reads each store through its own seeded
epochs, splits over data-parallel ranks as one store does, resumes exactly, refuses what cannot be mixed
(before any work), and trains and evaluates in a Trainer."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_local_reads import assert_same, runtimes  # noqa: E402

from letter_stores import letter_store  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.resume import load_run_config  # noqa: E402
from longctx.data.loader import BatchLoader, PackedSamples  # noqa: E402
from longctx.data.store_mix import StoreMix, blend_schedule, mix_line  # noqa: E402
from longctx.errors import ConfigError, DataError  # noqa: E402
from longctx.parallel.context.shares import local_batch, read_local_batch  # noqa: E402
from longctx.train.setup import build_data  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

SEQ = 64
LETTERS = "abc"
BASE = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.warmup_steps=1", "--metrics.plots=false",
        "--metrics.progress=false", "--train.device=cpu", "--model.layers=1", "--train.eval_interval=0"]


def quiet(*_a, **_k):
    pass


def build(tmp, letter, n_docs, seq_len=SEQ, eval_fraction=0.0):
    """A store whose every document is made of `letter` (and spaces): each sample says which store it is from."""
    return letter_store(tmp, letter, n_docs, seq_len=seq_len, eval_fraction=eval_fraction, chars=(20, 60),
                        name=f"{letter}{'' if seq_len == SEQ else seq_len}", src_name=f"in-{letter}-{seq_len}")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    return [build(tmp, letter, n, eval_fraction=0.3) for letter, n in zip(LETTERS, (40, 12, 24))]


def mix(stores, weights=None, seed=0, split="train"):
    return StoreMix([PackedSamples(s, split) for s in stores], [str(s) for s in stores], weights, seed)


def store_by_content(batch) -> list[int]:
    """Which store each row's text came from (its letter)."""
    return [next(LETTERS.index(chr(t)) for t in row.tolist() if chr(t) in LETTERS) for row in batch.tokens]


def assert_prefixes_within_one(choice, weights):
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[choice], axis=0)
    ideal = np.arange(1, len(choice) + 1)[:, None] * np.asarray(weights)[None]
    worst = np.abs(counts - ideal).max()
    assert worst < 1, worst


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_every_prefix_of_the_schedule_is_within_one_sample_of_the_weights(n):
    rng = np.random.default_rng(n)
    for _ in range(30):
        w = rng.random(n) ** 3
        w[rng.integers(n)] = 0 if n > 2 else w[0]  # (a store of weight 0 is never drawn)
        w = w / w.sum()
        choice = blend_schedule(w, [0] * n, 0, 2000)
        assert_prefixes_within_one(choice, w)
        assert not np.isin(np.flatnonzero(w == 0), choice).any()


def test_the_greedy_deficit_alone_strays_past_one_sample_where_the_schedule_does_not():
    """Why the schedule is Tijdeman's rule and not the plain largest-deficit greedy (module docstring): five
    stores weighed 12:1:1:12:3 put the greedy 1.03 samples off its weights."""
    w = np.asarray([12, 1, 1, 12, 3]) / 29
    counts, worst = np.zeros(5), 0.0
    for k in range(400):
        counts[int(np.argmax(w * (k + 1) - counts))] += 1
        worst = max(worst, float(np.abs(counts - w * (k + 1)).max()))
    assert worst > 1
    assert_prefixes_within_one(blend_schedule(w, [0] * 5, 0, 400), w)


def test_the_mix_reads_each_store_in_its_weight_at_every_prefix(stores):
    m = mix(stores, [0.5, 0.3, 0.2])
    assert m.identity["train_samples"] == len(m) == sum(len(s) for s in m.stores)
    chosen = m.stores_of(range(600))
    assert_prefixes_within_one(chosen, m.weights)
    batch = m.batch(list(range(40)))  # the rows' content is their store's
    assert store_by_content(batch) == chosen[:40].tolist()


def test_proportional_weights_by_default_and_each_store_cycles_its_own_seeded_epochs(stores):
    m = mix(stores)
    sizes = np.asarray([len(s) for s in m.stores])
    assert np.allclose(m.weights, sizes / sizes.sum())
    # store 1 (12 documents, weight 0.5) repeats: every one of its epochs is a permutation of its samples
    m = mix(stores, [1, 2, 0])
    where = [m.locate(k) for k in range(6 * len(m.stores[1]))]
    mine = [j for s, j in where if s == 1]
    n1 = len(m.stores[1])
    epochs = [mine[e * n1:(e + 1) * n1] for e in range(len(mine) // n1)]
    assert len(epochs) >= 3 and all(sorted(e) == list(range(n1)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert all(s != 2 for s, _ in where)


def test_the_blend_is_the_same_under_a_seed_and_another_under_another(stores):
    a, b, c = mix(stores, [2, 1, 1], seed=5), mix(stores, [2, 1, 1], seed=5), mix(stores, [2, 1, 1], seed=6)
    ka, kb, kc = ([m.locate(k) for k in range(200)] for m in (a, b, c))
    assert ka == kb and ka != kc
    assert [s for s, _ in ka] == [s for s, _ in kc]  # the schedule is the weights'; the seed shuffles the stores
    assert torch.equal(a.batch([7, 3, 150]).tokens, b.batch([7, 3, 150]).tokens)


def test_the_loader_draws_the_blend_in_order_and_resumes_it_exactly(stores):
    m = mix(stores, [0.6, 0.4, 0])
    loader = BatchLoader(m, 4, seed=0, dp=2)
    first = [loader.next_indices() for _ in range(3)]
    assert sorted(i for b in first for i in b) == list(range(12))  # blend positions, each batch cost-balanced
    state = loader.state_dict()
    assert state["store"] == m.identity and state["cursor"] == 12
    later = [loader.next_indices() for _ in range(3)]
    again = BatchLoader(mix(stores, [0.6, 0.4, 0]), 4, seed=0, dp=2)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [again.next_indices() for _ in range(3)] == later
    other = BatchLoader(mix(stores, [0.4, 0.6, 0]), 4, seed=0, dp=2)
    with pytest.raises(DataError, match="a mix of .* rebuilt with other content"):
        other.load_state_dict(state)


@pytest.mark.parametrize("layout", [dict(dp_shard=2), dict(dp_shard=2, ctx=2), dict(dp_replicate=2, head=2)])
def test_data_parallel_ranks_read_their_rows_of_the_global_batch(stores, layout):
    """Each rank reads its share of a mix's global batch straight from the stores (read_local_batch), and it is
    the share cut from the whole batch one process reads; the label count is the global batch's."""
    m = mix(stores, [0.5, 0.25, 0.25])
    ranks = list(runtimes(**layout))
    loader = BatchLoader(m, 8, seed=0, dp=ranks[0].dp)
    for _ in range(2):
        indices = loader.next_indices()
        whole = m.batch(indices)
        rows = []
        for rt in ranks:
            share, valid = read_local_batch(rt, m, indices)
            assert_same(share, local_batch(rt, whole))
            assert valid == whole.valid_tokens
            rows.append(rt.dp_rows(len(indices)))
        assert {(r.start, r.stop) for r in rows} == {(i * 8 // ranks[0].dp, (i + 1) * 8 // ranks[0].dp)
                                                     for i in range(ranks[0].dp)}


def cfg_of(stores, *extra):
    return load_config(None, [*BASE, f"--data.path={','.join(str(s) for s in stores)}", *extra])


@pytest.mark.parametrize("path, weights, message", [
    ("a,b", "1", "data.weights has 1 weight (1) but data.path names 2 stores"),
    ("a,b", "1,-1", "must be finite numbers >= 0"),
    ("a,b", "nan,1", "must be finite numbers >= 0"),
    ("a,b", "0,0", "are all zero"),
    ("", "1,2", "data.path is not set"),
    ("a,b,./a", "", "names the store ./a twice"),
    ("a,b", "x,y", "comma-separated numbers"),
])
def test_config_refusals(path, weights, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"--data.path={path}", f"--data.weights={weights}"])


def test_a_store_of_another_length_tokenizer_or_prefix_is_refused_naming_it(stores, tmp_path):
    other_len = build(tmp_path, "a", 10, seq_len=32)
    with pytest.raises(ConfigError, match=f"the data store {other_len} holds samples of 32 tokens"):
        build_data(cfg_of([stores[0], other_len]), log=quiet)
    for key, value, what in [("identity", "f" * 64, "tokenizer"), ("text_prefix", [1], "text prefix")]:
        copy = tmp_path / f"copy-{key}"
        shutil.copytree(stores[1], copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["tokenizer"][key] = value
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=f"must share one {what}") as e:
            build_data(cfg_of([stores[0], copy]), log=quiet)
        assert f"{stores[0].name}: " in str(e.value) and f"{copy.name}: " in str(e.value)


def test_a_mix_cannot_be_planned_nor_carry_synthetic_samples(stores):
    from longctx.planner.cli import _with_store

    base = cfg_of(stores[:2])
    with pytest.raises(ConfigError, match="mixes several stores, but a plan costs"):
        _with_store(None, "--model.preset=debug", [], base)
    with pytest.raises(ConfigError, match="does not apply to a mix of stores"):
        cfg_of(stores[:2], "--data.synthetic=passkey:0.2")


def test_one_store_with_its_weight_is_the_store_as_before(stores):
    train, _ = build_data(cfg_of(stores[:1], "--data.weights=1"), log=quiet)
    assert type(train) is PackedSamples


def test_the_setup_line_says_each_stores_share_and_epochs(stores):
    said = []
    train, evals = build_data(cfg_of(stores, "--data.weights=0.5,0.3,0.2", "--train.steps=30",
                                     "--train.eval_interval=5"), log=said.append)
    line = next(s for s in said if s.startswith("data: mix: "))
    n = [len(s) for s in train.stores]
    labels = [w * np.mean(st.label_counts) for w, st in zip(train.weights, train.stores)]  # (per sample)
    share = labels[0] / sum(labels)  # the loss's share, not the samples': stores of other fill differ
    assert f"a 50% ({0.5 * 120 / n[0]:.1f} epochs of {n[0]:,} samples; {share:.0%} of the tokens trained on)" in line
    assert f"b 30% ({0.3 * 120 / n[1]:.1f} epochs" in line and "c 20%" in line
    few = mix_line(train, 1)  # (a share of a few samples is said as such, not as "0.0 epochs")
    assert "0.0 epochs" not in few and f"a 50% ({0.5 / n[0]:.1g} epochs" in few
    assert isinstance(evals, StoreMix) and np.allclose(evals.weights, train.weights)
    assert len(evals) == sum(json.loads((s / "manifest.json").read_text())["totals"]["eval_samples"] for s in stores)
    assert len(evals) != len(train)  # the stores' eval splits
    assert_prefixes_within_one(evals.stores_of(range(len(evals))), evals.weights)


def run(tmp_path, stores, steps, *extra):
    cfg = cfg_of(stores, "--data.weights=0.6,0.3,0.1", f"--train.run_dir={tmp_path / 'run'}",
                 f"--train.steps={steps}", "--checkpoint.interval=2", *extra)
    return Trainer(cfg, log=quiet).run()


def test_a_trainer_run_on_a_mix_evaluates_on_the_blend_and_resumes_exactly(stores, tmp_path):
    whole = run(tmp_path / "whole", stores, 4, "--train.eval_interval=2")
    assert len(whole.losses) == 4 and all(np.isfinite(whole.losses))
    assert set(whole.eval_losses) == {2, 4} and all(np.isfinite(list(whole.eval_losses.values())))
    run(tmp_path / "cut", stores, 2, "--train.eval_interval=2")
    cfg, _ = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path / 'cut' / 'run'}",
                                    "--train.steps=4"], layout_given=False)
    resumed = Trainer(cfg, log=quiet).run()
    assert resumed.first_step == 3 and resumed.losses == whole.losses[2:]
    assert resumed.eval_losses[4] == whole.eval_losses[4]


def test_a_resume_on_another_mix_is_refused_unless_changes_are_allowed(stores, tmp_path):
    run(tmp_path, stores, 2)
    args = ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path / 'run'}", "--train.steps=3",
            "--data.weights=0.3,0.3,0.4", "--checkpoint.allow_changes=true"]
    said = []
    cfg, _ = load_run_config(None, args, layout_given=False)
    Trainer(cfg, log=lambda *a, **_: said.append(" ".join(map(str, a))))
    assert any("a mix of" in s and "each store goes on from its own place" in s for s in said)
    from longctx.train.stages import StagedLoader

    position = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    loader = StagedLoader(load_config(None, [*BASE, f"--data.path={','.join(map(str, stores))}",
                                             "--data.weights=0.3,0.3,0.4"]),
                          lambda c: build_data(c, quiet), dp=1)
    loader.load_state_dict(position["sampler"])
    with pytest.raises(DataError, match="rebuilt with other content"):
        loader.enter(3)
