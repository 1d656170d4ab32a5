"""A mix's store of weight 0 (data.weights) is never drawn, yet its eval samples counted in the eval set's size
(train/evaluation.py: n = min(len(evals), ...)) and in mix_eval_problem: the weighed stores' few eval samples were
evaluated several times over, unevenly, and evaluation stayed on when they held less than one global batch. Only
the stores of weight > 0 count now. And a store without training samples beside data.weights = '' (no weight
given) was refused for "its weight in data.weights": said for that case."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from letter_stores import letter_store
from longctx.config import load_config
from longctx.errors import DataError
from longctx.train import evaluation
from longctx.train.setup import build_data, check_mix


def _store(tmp: Path, letter: str, n_docs: int, eval_fraction: float) -> Path:
    return letter_store(tmp, letter, n_docs, eval_fraction=eval_fraction, numbered=True)


def _cfg(*stores, weights="1,0", batch=4):
    return load_config(None, ["--train.seq_len=64", f"--train.global_batch={batch}", "--train.eval_interval=5",
                              "--train.device=cpu", f"--data.path={','.join(map(str, stores))}",
                              f"--data.weights={weights}"])


def _evaluated(cfg, evals) -> list[int]:
    """The blend positions evaluate_eval_set reads (the forward stubbed out)."""
    read = []

    def read_local(rt, samples, indices):
        read.extend(indices)
        return None, len(indices)

    trainer = SimpleNamespace(model=torch.nn.Linear(1, 1), eval_samples=evals, micro_step_sequences=4, cfg=cfg,
                              rt=SimpleNamespace(sum_tensor=lambda t: t), device=torch.device("cpu"),
                              sampler=SimpleNamespace(stage=SimpleNamespace(global_batch=4)), autocast_dtype=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "read_local_batch", read_local)
        mp.setattr(evaluation, "to_device", lambda share, device: share)
        mp.setattr(evaluation, "store_sums", lambda trainer: None)
        mp.setattr(evaluation, "forward_loss_sum", lambda *a: torch.zeros((), dtype=torch.float64))
        evaluation.evaluate_eval_set(trainer, lambda batches, valid: valid)
    return read


def test_a_weighed_store_under_one_global_batch_of_eval_samples_turns_evaluation_off(tmp_path):
    a, b = _store(tmp_path, "a", 12, 0.2), _store(tmp_path, "b", 60, 0.5)
    said = []
    train, evals = build_data(_cfg(a, b), log=said.append)
    assert [len(s) for s in train.stores][1] > 0 and evals is None
    assert any(f"evaluation is off: the eval split of {a} has 3 samples, fewer than one global batch of 4" in line
               for line in said), said


def test_the_eval_set_is_the_weighed_stores_samples_each_once(tmp_path):
    a, b = _store(tmp_path, "a", 30, 0.2), _store(tmp_path, "b", 60, 0.5)
    said = []
    cfg = _cfg(a, b)
    _, evals = build_data(cfg, log=said.append)
    size_a, size_b = (len(s) for s in evals.stores)
    assert 4 <= size_a < cfg.train.eval_batches * 4 < size_a + size_b  # (the case: b's samples would fill it)
    read = _evaluated(cfg, evals)
    assert len(read) == size_a // 4 * 4
    samples = [evals.locate(k) for k in read]
    assert {s for s, _ in samples} == {0} and len(set(samples)) == len(samples)  # store a's, none twice
    assert any(f"{size_a:,} eval samples" in line for line in said), said


def test_a_store_without_training_samples_and_no_weights_given_is_told_so(tmp_path):
    a, b = _store(tmp_path, "a", 30, 0.2), _store(tmp_path, "b", 30, 0.2)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["totals"]["train_samples"] = 0  # (a store whose documents all went to its eval split)
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"the data store {b} of the mix has no training samples, so it would never be "
                                        r"read \(data.weights is '': each store is weighed by its training samples\)"):
        check_mix(_cfg(a, b, weights=""))
    with pytest.raises(DataError, match="so its weight in data.weights cannot be drawn"):
        check_mix(_cfg(a, b, weights="1,1"))
