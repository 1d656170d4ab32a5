"""train.stages with each stage's own GLOBAL_BATCH, grad accumulation and 2 data-parallel gloo ranks (audit
stages109): every step the two ranks' rows, over its micro-batches, are the rows one process trains (the same
samples at the stage's length, the stage's batch), and the losses are one process's."""

from longctx.config import load_config
from longctx.job.spawn import run_spawned

ARGS = ["--train.stages=64:2:8,128:2:4", "--train.grad_accum=2", "--train.warmup_steps=1", "--data.max_docs=40",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--train.eval_interval=0"]


def _train(run_dir: str):
    """Losses, and per step: the rows (as token tuples) this rank trained, over the step's micro-batches."""
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*ARGS, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    steps, step_batches = [], trainer.sampler.step_batches

    def recording(step):
        batches = step_batches(step)
        steps.append(sorted(tuple(row) for share, _ in batches for row in share.tokens.tolist()))
        return batches

    trainer.sampler.step_batches = recording
    return trainer.run().losses, steps


def test_two_ranks_with_accumulation_train_one_process_stage_batches(tmp_path):
    single_losses, single = _train(str(tmp_path / "single"))
    assert [(len(rows), len(rows[0])) for rows in single] == [(8, 64), (8, 64), (4, 128), (4, 128)]
    ranks = run_spawned(2, _train, str(tmp_path / "dp2"))
    for step, rows in enumerate(single):
        mine = [seen[step] for _, seen in ranks]
        assert [len(m) for m in mine] == [len(rows) // 2] * 2  # each rank half of the stage's batch
        assert sorted(mine[0] + mine[1]) == rows
    for losses, _ in ranks:
        assert max(abs(a - b) for a, b in zip(losses, single_losses)) <= 1e-5
