"""co2 with the hpz settings job/checks.py still accepts trains (layout matrix audit).

hpz over part of a co2 replica hung every rank in set-up and is refused before launch now
(tests/unit/test_layout_matrix_audit_co2_hpz.py); the settings the refusal names instead, a secondary partition
of the whole replica (plain resharding) or of 1 rank (no resharding after forward), build no mesh: on 2 replicas
of 2 ranks both train, to co2 without hpz's losses (resharding changes where weights live, not the arithmetic)."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

pytestmark = pytest.mark.slow  # one 4-rank job of three 3-step runs: ~35 s on a 2-core CPU

BASE = ["--train.steps=3", "--train.seq_len=64", "--train.eval_interval=0", "--metrics.plots=false",
        "--metrics.progress=false", "--data.max_docs=200", "--checkpoint.final=false", "--train.warmup_steps=1",
        "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.data_parallel=co2", "--train.co2_local_steps=2"]


def _losses(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def test_hpz_over_a_whole_replica_or_one_rank_trains_as_co2_without_it(tmp_path):
    hpz = ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2"]
    out = run_spawned_many(4, [("plain", _losses, ([], str(tmp_path / "plain"))),
                               ("replica", _losses, (hpz, str(tmp_path / "replica"))),
                               ("one", _losses, ([*hpz, "--parallel.hpz_ranks=1"], str(tmp_path / "one")))])
    plain = out["plain"][0]
    assert len(plain) == 3
    for key in ("replica", "one"):
        assert all(r == out[key][0] for r in out[key])  # (every rank reports the job's losses)
        assert max(abs(a - b) for a, b in zip(plain, out[key][0])) < 1e-6, (key, plain, out[key][0])
