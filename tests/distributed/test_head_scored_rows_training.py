"""Training with the LM head over the scored rows only (ops/loss.py scored_rows, made by Batch.to on the host):
on a store of instruction pairs (only the responses' labels scored), the per-step losses and the final weights
equal the run whose head sees every row, in one process and under head 2 x ctx 2 (4 gloo ranks), and the head
of a step really ran over fewer rows."""

import torch
from test_instruction_pairs_ranks import SEQ, store  # noqa: F401 (the store of instruction pairs, a fixture)

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

ARGS = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.steps=3", "--train.warmup_steps=1",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=2",
        "--train.eval_interval=0", "--checkpoint.final=false", "--memory.loss_chunk=64"]


def _train(args, run_dir, skip: bool):
    """Losses, the final local weights, and the rows the LM head saw over the run."""
    import longctx.ops.loss as loss_mod
    from longctx.train.trainer import Trainer

    default = loss_mod.SCORED_SHARE_MAX
    loss_mod.SCORED_SHARE_MAX = default if skip else -1.0  # (-1: no batch gets an index: every row, as before)
    seen, plain = [], loss_mod.lm_head_loss

    def counting(h, *a, rows=None, **k):
        seen.append(h.shape[0] if rows is None else rows.numel())
        return plain(h, *a, rows=rows, **k)

    import longctx.models.llama as llama
    llama.lm_head_loss = counting
    try:
        trainer = Trainer(load_config(None, [*ARGS, *args, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
        losses = trainer.run().losses
    finally:
        llama.lm_head_loss, loss_mod.SCORED_SHARE_MAX = plain, default
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return losses, {k: local(v).detach().clone() for k, v in trainer.model.state_dict().items()}, sum(seen)


def _equal(skip, full, name):
    (l1, w1, rows1), (l0, w0, rows0) = skip, full
    assert rows1 < rows0 / 4, (name, rows1, rows0)  # (responses: a few tokens of each sample)
    assert max(abs(a - b) for a, b in zip(l1, l0, strict=True)) <= 1e-6, (name, l1, l0)
    # fp32 sums over other rows (the chunks hold other rows) round otherwise (losses: 1e-7 relative), and AdamW's
    # division by sqrt(v) lifts a gradient's rounding to lr's scale where the gradient is near 0: 3e-6 seen
    # after 3 steps, the weights moving ~1e-3; a dropped or doubled label moves them by ~lr
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=2e-5, msg=f"{name}: {k}")


def test_scored_rows_train_as_every_row_in_one_process(store, tmp_path):  # noqa: F811
    args = [f"--data.path={store}"]
    _equal(_train(args, str(tmp_path / "skip"), True), _train(args, str(tmp_path / "full"), False), "one process")


def test_scored_rows_train_as_every_row_under_head_and_ctx(store, tmp_path):  # noqa: F811
    args = [f"--data.path={store}", "--parallel.head=2", "--parallel.ctx=2"]
    ranks = run_spawned_many(4, [("skip", _train, (args, str(tmp_path / "skip"), True)),
                                 ("full", _train, (args, str(tmp_path / "full"), False))])
    for rank, (skip, full) in enumerate(zip(ranks["skip"], ranks["full"], strict=True)):
        _equal(skip, full, f"rank {rank}")
