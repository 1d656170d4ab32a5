"""The in-training evaluation of a mix reads the training blend's weights over the stores' eval splits (docs/data.md
"Mixtures of stores"), also with data.weights = '' (each store weighed by its training samples): weighed by their
eval splits' sizes instead, stores built with other eval fractions blended otherwise in eval than in training."""

from pathlib import Path

import numpy as np

from letter_stores import letter_store
from longctx.config import load_config
from longctx.train.setup import build_data


def _store(tmp: Path, letter: str, eval_fraction: float) -> Path:
    return letter_store(tmp, letter, 60, eval_fraction=eval_fraction, numbered=True)


def test_the_eval_blend_has_the_training_weights_when_they_are_the_stores_sizes(tmp_path):
    a, b = _store(tmp_path, "a", 0.5), _store(tmp_path, "b", 0.1)
    cfg = load_config(None, ["--train.seq_len=64", "--train.global_batch=4", "--train.eval_interval=5",
                             "--train.device=cpu", f"--data.path={a},{b}"])
    train, evals = build_data(cfg, log=lambda *a, **k: None)
    sizes = np.asarray([len(s) for s in train.stores], dtype=np.float64)
    assert np.allclose(train.weights, sizes / sizes.sum())
    eval_sizes = np.asarray([len(s) for s in evals.stores], dtype=np.float64)
    assert not np.allclose(eval_sizes / eval_sizes.sum(), train.weights, atol=0.05)  # (the case: they differ)
    assert np.allclose(evals.weights, train.weights)
    chosen = np.bincount(evals.stores_of(range(400)), minlength=2) / 400
    assert np.allclose(chosen, train.weights, atol=1 / 400)


def test_finite_weights_whose_sum_overflows_blend_as_their_ratio(tmp_path):
    """data.weights = "1e308,1e308" passes the config's rule (finite, >= 0) but its sum is inf: the weights were
    0, 0 and the first blend position crashed with "min() arg is an empty sequence"."""
    a, b = _store(tmp_path, "a", 0.0), _store(tmp_path, "b", 0.0)
    cfg = load_config(None, ["--train.seq_len=64", "--train.global_batch=4", "--train.eval_interval=0",
                             "--train.device=cpu", f"--data.path={a},{b}", "--data.weights=1e308,1e308"])
    train, _ = build_data(cfg, log=lambda *a, **k: None)
    assert np.allclose(train.weights, [0.5, 0.5])
    assert np.bincount(train.stores_of(range(100)), minlength=2).tolist() == [50, 50]
