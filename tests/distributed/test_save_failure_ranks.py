"""A save that fails on one rank only (its disk full: LONGCTX_FAULT=enospc@2 set in rank 1 alone),
2 ranks (ctx 2), sync and async: both ranks stop with a CheckpointError (rank 0 learns it from the
agreement, not from its own write), nothing of step 4 is left or committed, and `latest` still
names step 2."""

import os

import torch.distributed as dist
from test_training_parity import BASE

from longctx.config import load_config
from longctx.config.checkpoint_paths import LATEST, CheckpointError
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import Trainer


def checkpoint_error_of_a_run(args, run_dir) -> str | None:
    """A 6-step ctx 2 run saving every 2 steps: the CheckpointError it stops with (None: it finished)."""
    try:
        cfg = load_config("configs/debug.toml", [*BASE, "--train.steps=6", "--checkpoint.interval=2",
                                                 "--parallel.ctx=2", *args, f"--train.run_dir={run_dir}"])
        Trainer(cfg, log=lambda *a, **k: None).run()
    except CheckpointError as e:
        return str(e)
    return None


def _fail_on_rank1(args, run_dir):
    if dist.get_rank() == 1:
        os.environ["LONGCTX_FAULT"] = "enospc@2"
    try:
        return checkpoint_error_of_a_run(args, run_dir)
    finally:
        os.environ.pop("LONGCTX_FAULT", None)


def test_one_ranks_full_disk_stops_every_rank_and_commits_nothing(tmp_path):
    runs = run_spawned_many(2, [(mode, _fail_on_rank1, ([f"--checkpoint.async={mode == 'async'}".lower()],
                                                       str(tmp_path / mode))) for mode in ("sync", "async")])
    for mode, (rank0, rank1) in runs.items():
        assert rank0 is not None and rank1 is not None, (mode, rank0, rank1)
        assert "step 4 could not be written" in rank0 and "another rank's write failed" in rank0, rank0
        assert "No space left on device" in rank1, rank1
        root = tmp_path / mode / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == [LATEST, "step-00000002"], mode
        assert (root / LATEST).read_text().strip() == "step-00000002"

