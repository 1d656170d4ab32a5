"""The eval loss is the same under every layout and grad_accum: 4 gloo ranks as head 2 x ctx 2
(grad_accum 4) and dp 2 x ctx 2 (grad_accum 2) against one process with grad_accum 1."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.slow  # two 4-rank runs (one spawned job)
ARGS = ["--train.seq_len=128", "--data.max_docs=120", "--model.layers=2", "--train.global_batch=4",
        "--train.eval_interval=2", "--train.eval_batches=2", "--train.steps=2", "--data.eval_fraction=0.1",
        "--metrics.plots=false", "--metrics.progress=false"]


def _eval(run_dir, extra):
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*ARGS, *extra, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    return trainer.evaluate(), trainer.run().eval_losses[2]


def test_eval_loss_does_not_depend_on_layout_or_grad_accum(tmp_path):
    ref = _eval(tmp_path / "one", ["--train.grad_accum=1"])
    layouts = {"head2xctx2-ga4": ["--parallel.head=2", "--parallel.ctx=2", "--train.grad_accum=4"],
               "dp2xctx2-ga2": ["--parallel.ctx=2", "--train.grad_accum=2"]}
    runs = run_spawned_many(4, [(name, _eval, (str(tmp_path / name), extra)) for name, extra in layouts.items()])
    for name in layouts:
        for before, after in runs[name]:
            assert abs(before - ref[0]) <= 1e-6, (name, before, ref[0])
            assert abs(after - ref[1]) <= 1e-5, (name, after, ref[1])  # after 2 steps of differently-ordered sums
