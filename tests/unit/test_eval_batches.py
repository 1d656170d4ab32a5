"""Evaluation reads train.eval_batches global batches, so its loss does not depend on grad_accum
(the micro-batch only decides how many sequences are in flight at once)."""

from longctx.config import load_config
from longctx.train.trainer import Trainer

ARGS = ["--train.seq_len=128", "--data.max_docs=120", "--model.layers=2", "--train.global_batch=4",
        "--train.eval_interval=4", "--train.eval_batches=2", "--train.steps=4", "--data.eval_fraction=0.1",
        "--metrics.plots=false", "--metrics.progress=false"]


def _trainer(tmp_path, grad_accum: int) -> Trainer:
    cfg = load_config("configs/debug.toml", [*ARGS, f"--train.grad_accum={grad_accum}",
                                             f"--train.run_dir={tmp_path / str(grad_accum)}"])
    return Trainer(cfg, log=lambda *a, **k: None)


def test_eval_loss_is_the_same_under_any_grad_accum(tmp_path):
    one, four = _trainer(tmp_path, 1), _trainer(tmp_path, 4)
    assert len(one.eval_samples) >= 8  # two global batches of 4
    # the same weights (seeded): the same eval loss
    assert abs(one.evaluate() - four.evaluate()) <= 1e-6
    # and after training (grad_accum only reorders the gradient sums)
    a, b = one.run().eval_losses, four.run().eval_losses
    assert list(a) == list(b) == [4]
    assert abs(a[4] - b[4]) <= 1e-6, f"{a[4]} vs {b[4]}"
