"""A mix of stores (data/store_mix.py) under data parallelism (2 gloo ranks): each rank reads its rows of the same
global batches of the blend straight from the stores, together exactly the batches one process reads, and the
losses are one process's."""


import pytest

from letter_stores import letter_store
from longctx.config import load_config
from longctx.job.spawn import run_spawned

SEQ = 64
ARGS = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.steps=3", "--train.warmup_steps=1",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--train.eval_interval=0", "--data.weights=0.7,0.3"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix_ranks")
    out = []
    for letter, n in (("a", 30), ("b", 10)):
        out.append(str(letter_store(tmp, letter, n, seq_len=SEQ, chars=50, seed=letter)))
    return ",".join(out)


def _train(paths: str, run_dir: str):
    """Losses, and per micro-batch: the global batch's blend positions and this rank's rows' tokens."""
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*ARGS, f"--data.path={paths}", f"--train.run_dir={run_dir}"]),
                      log=lambda *a, **k: None)
    seen, read_local = [], trainer.sampler.read_local

    def recording(samples, indices):
        share, valid = read_local(samples, indices)
        seen.append((sorted(indices), [tuple(row) for row in share.tokens.tolist()], valid))
        return share, valid

    trainer.sampler.read_local = recording
    return trainer.run().losses, seen


def test_two_data_parallel_ranks_read_one_process_global_batches_of_the_blend(stores, tmp_path):
    single_losses, single = _train(stores, str(tmp_path / "single"))
    ranks = run_spawned(2, _train, stores, str(tmp_path / "dp2"))
    assert len(ranks) == 2 and len(single) == 3
    for step, (indices, rows, valid) in enumerate(single):
        for _, seen in ranks:
            assert seen[step][0] == indices and seen[step][2] == valid  # the same global batch, label count
        mine = [seen[step][1] for _, seen in ranks]
        assert all(len(m) == 2 for m in mine)  # each rank half of the batch
        assert sorted(mine[0] + mine[1]) == sorted(rows)  # together: the single process's rows
    for losses, _ in ranks:
        assert max(abs(a - b) for a, b in zip(losses, single_losses)) <= 1e-4
