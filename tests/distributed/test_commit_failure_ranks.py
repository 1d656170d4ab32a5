"""Rank 0's commit of a save fails after every rank wrote its files (the disk fills at `latest`, or at the
manifest), 2 ranks (ctx 2), sync and async: every rank stops with a CheckpointError (before: rank 1 trained
on into a collective rank 0 never joined, until the watchdog), nothing of step 4 is left, and `latest` still
names step 2; on one process under on_save_error = warn the run trains on (before: the OSError ended it)."""

import pytest
import torch.distributed as dist
from test_save_failure_ranks import checkpoint_error_of_a_run
from test_training_parity import BASE

import longctx.checkpoint.manager as manager
from longctx.config import load_config
from longctx.config.checkpoint_paths import LATEST
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import Trainer


def _failing_at_second_latest(where: str):
    """write_text_durably (latest) or write_manifest that raise a full disk's error at the second save."""
    calls = {"n": 0}
    real = getattr(manager, where)

    def fail(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device (the commit)")
        return real(*args, **kwargs)
    return fail


def _commit_fails_on_rank0(where, args, run_dir):
    real = getattr(manager, where)
    if dist.get_rank() == 0:
        setattr(manager, where, _failing_at_second_latest(where))
    try:
        return checkpoint_error_of_a_run(args, run_dir)
    finally:
        setattr(manager, where, real)  # (the next job runs in this process)


def _left(root):
    return sorted(p.name for p in root.iterdir()), (root / LATEST).read_text().strip()


def test_rank0s_failed_commit_stops_every_rank_and_leaves_nothing(tmp_path):
    jobs = [((where, mode), _commit_fails_on_rank0, (where, [f"--checkpoint.async={str(mode == 'async').lower()}"],
                                                     str(tmp_path / where / mode)))
            for where in ("write_text_durably", "write_manifest") for mode in ("sync", "async")]
    runs = run_spawned_many(2, jobs)
    for (where, mode), (rank0, rank1) in runs.items():
        assert rank0 is not None and rank1 is not None, (where, mode, rank0, rank1)
        assert "step 4 could not be written" in rank0 and "(the commit)" in rank0, rank0
        assert "step 4 could not be written" in rank1 and "rank 0 could not commit it" in rank1, rank1
        assert _left(tmp_path / where / mode / "checkpoints") == ([LATEST, "step-00000002"], "step-00000002")


@pytest.mark.parametrize("async_save", [False, True])
def test_one_process_failed_commit_warns_and_trains_on(async_save, tmp_path, monkeypatch):
    monkeypatch.setattr(manager, "write_text_durably", _failing_at_second_latest("write_text_durably"))
    logs = []
    cfg = load_config("configs/debug.toml", [*BASE, "--train.steps=6", "--checkpoint.interval=2",
                                             "--checkpoint.on_save_error=warn",
                                             f"--checkpoint.async={str(async_save).lower()}",
                                             f"--train.run_dir={tmp_path}"])
    assert len(Trainer(cfg, log=lambda *a, **k: logs.append(" ".join(map(str, a)))).run().losses) == 6
    assert any("step 4 could not be written" in line and "Training goes on" in line for line in logs), logs
    names, latest = _left(tmp_path / "checkpoints")
    assert latest == "step-00000006" and "step-00000004" not in names and not [n for n in names if ".tmp" in n]
