"""A full disk at a save's temporary directory on one rank only (a node-local disk, or space freed between two
ranks' mkdir): that rank raised the failed-save error (and under checkpoint.on_save_error = warn trained on)
while the others went on alone into DCP's collective writes and waited for it: a hang, or a raw gloo error once
it left. Every rank now learns the failure, as a failed write inside the directory is agreed on (_finish)."""

import errno
from pathlib import Path

import pytest
import torch

from longctx.job.spawn import run_spawned

pytestmark = pytest.mark.usefixtures("one_thread")


def _save_with_a_full_disk_on_rank_1(root: str):
    import torch.distributed as dist

    from longctx.checkpoint.manager import CheckpointManager
    from longctx.config.checkpoint_paths import CheckpointError

    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ckpt = CheckpointManager(Path(root), keep=3, async_save=False, rank=rank, world=2, layout={}, model_cfg={},
                             log=lambda *a: None)
    ckpt.save(1, model, opt, {"cursor": 1})
    if rank == 1:
        mkdir = Path.mkdir

        def full(self, *args, **kwargs):
            if self.name.startswith(".tmp-step-00000002"):
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
            return mkdir(self, *args, **kwargs)

        Path.mkdir = full
    try:
        ckpt.save(2, model, opt, {"cursor": 2})
    except CheckpointError as e:
        said = str(e)
    else:
        said = "saved"
    ckpt.save(3, model, opt, {"cursor": 3})  # (the ranks still agree: the next save is made on both)
    return said


def test_every_rank_learns_a_full_disk_at_one_ranks_save_directory(tmp_path):
    said = run_spawned(2, _save_with_a_full_disk_on_rank_1, str(tmp_path), timeout=120.0)
    assert all("the checkpoint of step 2 could not be written" in s for s in said), said
    assert "No space left" in said[1] and "another rank" in said[0]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000003"]
    assert not list(tmp_path.glob(".tmp-*"))
