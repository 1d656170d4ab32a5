"""dp 2 x ctx 2 (4 gloo ranks): each rank reads from the store only the tokens it holds (plus the
next token of each run of them, for its labels), at most one step ahead, and trains exactly as when
every rank read the whole global batch and cut its share out of it. Both tests' 4-rank runs share
one spawned job (run_spawned_many), each with its own run directory."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

STEPS = 4
ARGS = [f"--train.steps={STEPS}", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=300", "--train.seq_len=256", "--train.global_batch=4", "--train.grad_accum=2",
        "--parallel.ctx=2"]


def _run(run_dir, how):
    """Losses, and per step: bytes read, bytes the rank's share allows, bytes already read ahead when
    the step starts."""
    from longctx.parallel.context import shares
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*ARGS, f"--train.run_dir={run_dir}/{how}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None, read_ahead=how == "ahead")
    rt, sampler = trainer.rt, trainer.sampler
    samples = sampler.train_samples
    itemsize = samples.parts[0].tokens.dtype.itemsize
    if how == "whole":  # the reference: every rank reads the whole global batch and cuts its share
        def read_local(samples, indices):
            whole = samples.batch(indices)
            return shares.local_batch(rt, whole), whole.valid_tokens
        sampler.read_local = read_local
    reads, allowed, ahead = [], [], []
    plan_share, read_local, step_batches = shares.plan_share, sampler.read_local, sampler.step_batches

    def recording_plan(rt, doc_ids, rows, seq_len):
        layout, held = plan_share(rt, doc_ids, rows, seq_len)
        runs = int((held[:, 1:] != held[:, :-1] + 1).sum()) + rows  # each run: one label look-ahead at most
        allowed.append((held.numel() + runs) * itemsize)
        return layout, held

    def recording_read(samples, indices):  # reads are one at a time: the counter's change is this read's
        before = samples.bytes_read
        out = read_local(samples, indices)
        reads.append(samples.bytes_read - before)
        return out

    def recording_step(step):
        ahead.append(samples.bytes_read - sum(reads[:2 * (step - 1)]))  # 2 micro-batches per step
        return step_batches(step)

    shares.plan_share, sampler.read_local, sampler.step_batches = recording_plan, recording_read, recording_step
    try:
        losses = trainer.run().losses
    finally:
        shares.plan_share = plan_share  # (the module's function, for the next run)
    per_step = lambda xs: [sum(xs[i:i + 2]) for i in range(0, len(xs), 2)]  # noqa: E731
    return losses, per_step(reads), per_step(allowed), ahead


def _compare(run_dir):
    return {how: _run(run_dir, how) for how in ("ahead", "sync", "whole")}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One 4-rank job: _compare (three trainings), then _evaluate; {key: per-rank results}."""
    base = tmp_path_factory.mktemp("rank_reads")
    return run_spawned_many(4, [("compare", _compare, (str(base / "compare"),)),
                                ("evaluate", _evaluate, (str(base / "evaluate" / "dp2-ctx2"),))])


def test_each_rank_reads_its_share_at_most_one_step_ahead_and_trains_as_before(spawned):
    results = spawned["compare"]
    seq_len, global_batch, itemsize = 256, 4, 2  # byte tokenizer: uint16 tokens
    batch_bytes = global_batch * seq_len * itemsize
    for rank, r in enumerate(results):
        losses, reads, allowed, ahead = r["ahead"]
        assert len(losses) == STEPS
        assert losses == r["sync"][0] == r["whole"][0], rank  # bit for bit
        assert reads == r["sync"][1]  # the same reads, only earlier
        for step, (read, share) in enumerate(zip(reads, allowed)):
            assert batch_bytes // 4 <= read <= share < batch_bytes // 3, (rank, step, read, share)
        # when a step starts, what was read beyond the steps before it is that step's read, no more
        assert ahead[0] == 0 and all(a <= nxt for a, nxt in zip(ahead[1:], reads[1:])), (rank, ahead, reads)
        assert r["sync"][3] == [0] * STEPS
        assert all(read >= batch_bytes for read in r["whole"][1])  # the old way: the whole batch, every rank


def _evaluate(run_dir):
    """(eval loss, bytes this rank read for it, bytes of the eval batches it covers) before any step."""
    from longctx.train.trainer import Trainer

    args = [*ARGS, "--train.eval_interval=2", "--train.eval_batches=2", f"--train.run_dir={run_dir}"]
    world_args = [a for a in args if a != "--parallel.ctx=2"] if run_dir.endswith("single") else args
    trainer = Trainer(load_config("configs/debug.toml", world_args), log=lambda *a, **k: None)
    samples = trainer.eval_samples
    before = samples.bytes_read
    loss = trainer.evaluate()
    batch = trainer.sampler.stage.global_batch  # eval_batches counts global batches
    covered = min(len(samples), 2 * batch) // batch * batch * samples.seq_len * samples.parts[0].tokens.dtype.itemsize
    return loss, samples.bytes_read - before, covered


def test_evaluation_reads_each_ranks_share_and_gives_the_single_process_loss(spawned, tmp_path):
    single, _, _ = _evaluate(str(tmp_path / "single"))
    for rank, (loss, read, covered) in enumerate(spawned["evaluate"]):
        assert abs(loss - single) <= 1e-5, (rank, loss, single)
        assert 0 < read < covered / 3, (rank, read, covered)  # a quarter of the tokens (+ label look-ahead)
