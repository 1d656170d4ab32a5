"""A process killed while keep-last rotation deletes an old checkpoint (checkpoint/retention.py prune):
shutil.rmtree is not atomic, and a kill halfway through it left a step-* directory behind: with its
manifest but not its shards (a damaged checkpoint that every reader took for a complete one), or without
its manifest (remains no later start or prune removed). Each pruned checkpoint is renamed out of the
step-* names first, so a kill leaves only a hidden leftover that the next start sweeps."""

import os
from pathlib import Path

import pytest
import torch

import longctx.checkpoint.manager as manager_module
from longctx.checkpoint.manager import CheckpointManager
from longctx.checkpoint.manifest import verify
from longctx.config.checkpoint_paths import complete_checkpoints, latest_checkpoint


class Killed(BaseException):
    """The kill -9, as far as this process can tell: nothing after it runs."""


def _manager(root):
    return CheckpointManager(root, keep=1, async_save=False, rank=0, world=1, layout={}, model_cfg={},
                             log=lambda *a, **k: None)


@pytest.mark.parametrize("first", ["__0_0.distcp", "manifest.json"])
def test_a_kill_during_rotation_leaves_no_partial_checkpoint(tmp_path, monkeypatch, first):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    root = tmp_path / "ckpt"
    manager = _manager(root)
    manager.save(2, model, optimizer, {"position": 0})
    manager.save(4, model, optimizer, {"position": 0})  # (keep 1: step 2 pruned whole, no kill)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004"]

    def dying_rmtree(path, *args, **kwargs):  # half the files deleted (`first` among them), then the kill
        files = sorted(Path(path).iterdir(), key=lambda p: (p.name != first, p.name))
        for f in files[: max(1, len(files) // 2)]:
            os.unlink(f)
        raise Killed

    monkeypatch.setattr(manager_module.shutil, "rmtree", dying_rmtree)  # (shutil's own: only the prune's runs)
    with pytest.raises(Killed):
        manager.save(6, model, optimizer, {"position": 0})
    monkeypatch.undo()

    _manager(root)  # the next start
    assert latest_checkpoint(root).name == "step-00000006"
    for checkpoint in complete_checkpoints(root):  # every checkpoint that looks complete is intact
        verify(checkpoint)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000006"]  # nothing left behind
