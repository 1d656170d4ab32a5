"""Each store's eval loss over a mix (train/evaluation.py): the mean over that store's labelled tokens among the
evaluated sequences, from the blend's one forward; their token-weighted mean is the blend's loss; each is what
the model gives those sequences of that store alone; the same under grad_accum and a chunked loss; written to
metrics.jsonl, the eval line and loss.png. One store writes what it wrote before."""

import json
import random

import pytest
import torch

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.store_mix import StoreMix
from longctx.train.report import _plot_store_evals
from longctx.train.trainer import Trainer

SEQ = 64
BASE = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.warmup_steps=1", "--train.lr=3e-3",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--train.eval_batches=3"]


def _build(tmp, name: str, alphabet: str, n_docs: int) -> str:
    """A store of `name` whose documents draw only from `alphabet`: repetitive text (one letter) is learnt fast,
    varied text (many letters and digits) is not, so the two stores' losses differ."""
    src = tmp / f"in-{name}"
    src.mkdir()
    rng = random.Random(name)
    for i in range(n_docs):
        (src / f"{i:03d}.txt").write_text("".join(rng.choice(alphabet) for _ in range(rng.randint(40, 90))))
    build_store(BuildOptions([str(src)], str(tmp / name), SEQ, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=0.4, progress=False, stats=False), log=lambda *a: None)
    return str(tmp / name)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_by_store")
    return [_build(tmp, "books", "aaaa ", 40), _build(tmp, "code", "qwertyuiopzxcvbnm0123456789{}();", 40)]


def _trainer(stores, run_dir, *extra, log=lambda *a, **k: None) -> Trainer:
    weights = ["--data.weights=0.5,0.5"] if len(stores) > 1 else []  # (one store: no weights, as before)
    cfg = load_config(None, [*BASE, *weights, f"--data.path={','.join(stores)}", f"--train.run_dir={run_dir}", *extra])
    return Trainer(cfg, log=log)


def _evaluated_positions(trainer) -> range:
    gb = trainer.sampler.stage.global_batch
    return range(min(len(trainer.eval_samples), trainer.cfg.train.eval_batches * gb) // gb * gb)


def _reference_losses(trainer) -> tuple[dict[str, float], dict[str, int]]:
    """Each store's loss over its evaluated sequences, read from that store alone and scored by the model's
    summed loss (not the per-token path the evaluation uses), and its label count."""
    mix: StoreMix = trainer.eval_samples
    where = [mix.locate(k) for k in _evaluated_positions(trainer)]
    losses, counts = {}, {}
    trainer.model.eval()
    with torch.no_grad():
        for s, name in enumerate(mix.names):
            b = mix.stores[s].batch([j for t, j in where if t == s])
            total = trainer.model(b.tokens, b.positions, b.doc_ids, labels=b.labels, loss_reduction="sum")
            counts[name] = int((b.labels != -100).sum())
            losses[name] = float(total) / counts[name]
    trainer.model.train()
    return losses, counts


@pytest.fixture(scope="module")
def trained(stores, tmp_path_factory):
    """A trainer after 4 steps on the mix (its eval at step 4 recorded), and what it said."""
    said = []
    trainer = _trainer(stores, tmp_path_factory.mktemp("run") / "run", "--train.steps=4", "--train.eval_interval=4",
                       log=lambda *a, **k: said.append(" ".join(map(str, a))))
    return trainer, trainer.run(), said


def test_each_store_has_its_own_loss_and_their_token_weighted_mean_is_the_blends(trained):
    trainer, result, _ = trained
    assert list(result.eval_by_store) == [4] and list(result.eval_losses) == [4]
    by_store, blend = result.eval_by_store[4], result.eval_losses[4]
    assert list(by_store) == ["books", "code"]
    assert by_store["books"] < by_store["code"] - 0.3, by_store  # repetitive text is learnt first
    _, counts = _reference_losses(trainer)
    assert min(counts.values()) > 0
    weighted = sum(counts[n] * by_store[n] for n in by_store) / sum(counts.values())
    assert weighted == pytest.approx(blend, rel=1e-12, abs=1e-12)
    # evaluating again gives the same figures (a fixed set of sequences)
    assert trainer.evaluate() == pytest.approx(blend, rel=1e-12) and trainer.last_eval.by_store == by_store


def test_each_stores_loss_is_the_models_loss_over_its_sequences_alone(trained):
    trainer, result, _ = trained
    reference, _ = _reference_losses(trainer)
    for name, loss in result.eval_by_store[4].items():
        assert loss == pytest.approx(reference[name], rel=1e-5), name


def _untagged(record: dict) -> dict:
    """The record without the run's id and attempt (train/run_identity.py: in every record, checked there)."""
    assert {"run_id", "run_attempt"} <= record.keys()
    return {k: v for k, v in record.items() if k not in ("run_id", "run_attempt")}


def test_the_eval_record_and_line_give_each_stores_loss(trained):
    trainer, result, said = trained
    records = [json.loads(line) for line in trainer.metrics.path.read_text().splitlines()]
    evals = [_untagged(r) for r in records if r["kind"] == "eval"]
    assert evals == [{"kind": "eval", "step": 4, "loss": result.eval_losses[4], "by_store": result.eval_by_store[4]}]
    by_store = result.eval_by_store[4]
    line = f"step     4 | eval loss {result.eval_losses[4]:.4f} (books {by_store['books']:.4f}, " \
           f"code {by_store['code']:.4f})"
    assert line in said


@pytest.mark.parametrize("extra", [["--train.grad_accum=2"], ["--memory.loss_chunk=16"]])
def test_the_same_per_store_losses_under_grad_accum_and_a_chunked_loss(stores, tmp_path, extra):
    plain = _trainer(stores, tmp_path / "plain", "--train.steps=1", "--train.eval_interval=1")
    other = _trainer(stores, tmp_path / "other", "--train.steps=1", "--train.eval_interval=1", *extra)
    assert other.evaluate() == pytest.approx(plain.evaluate(), rel=1e-6)
    for name, loss in plain.last_eval.by_store.items():
        assert other.last_eval.by_store[name] == pytest.approx(loss, rel=1e-6), name


def test_one_store_writes_the_eval_record_and_line_as_before(stores, tmp_path):
    said = []
    trainer = _trainer(stores[:1], tmp_path / "one", "--train.steps=2", "--train.eval_interval=2",
                       log=lambda *a, **k: said.append(" ".join(map(str, a))))
    result = trainer.run()
    assert result.eval_by_store == {} and trainer.last_eval.by_store is None
    evals = [_untagged(json.loads(x)) for x in trainer.metrics.path.read_text().splitlines() if '"eval"' in x]
    assert evals == [{"kind": "eval", "step": 2, "loss": result.eval_losses[2]}]
    assert f"step     2 | eval loss {result.eval_losses[2]:.4f}" in said


class _Axes:
    def __init__(self):
        self.lines = []

    def plot(self, x, y, label=None, **_):
        self.lines.append((label, list(x), list(y)))


def test_loss_png_draws_each_stores_eval_loss_as_its_own_line():
    ax = _Axes()
    _plot_store_evals(ax, [{"step": 2, "loss": 2.0, "by_store": {"books": 1.0, "code": 3.0}},
                           {"step": 4, "loss": 1.5, "by_store": {"books": 0.5, "code": None}},
                           {"step": 6, "loss": 1.0}])
    assert [label for label, *_ in ax.lines] == ["eval: books", "eval: code"]
    assert list(ax.lines[0][1:]) == [[2, 4], [1.0, 0.5]]
    assert ax.lines[1][1][0] == 2 and ax.lines[1][2][0] == 3.0
    _plot_store_evals(ax := _Axes(), [{"step": 2, "loss": 2.0}])
    assert ax.lines == []
