"""A real full disk fails DCP's own write (torch.save: "unexpected pos ..."), which DCP raises as a
CheckpointException, a BaseException: `except Exception` in the manager let it through, so the run died with
DCP's raw traceback of every rank and the partial save stayed in the checkpoint directory, filling the disk.
It is a failed save like any other: removed, `latest` kept, one CheckpointError that says the cause in a line."""

import os

import pytest
import torch

from longctx.checkpoint.manager import CheckpointManager
from longctx.config.checkpoint_paths import CheckpointError


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_inside_dcp_fails_the_save_cleanly(tmp_path, monkeypatch, async_save):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=2, async_save=async_save, rank=0, world=1, layout={}, model_cfg={},
                                log=lambda *a, **k: None)
    manager.save(2, model, optimizer, {"position": 0})
    manager.wait()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # what torch.save says when the disk fills under it
        if not isinstance(f, (str, os.PathLike)):  # (DCP writes into its open .distcp file; the RNG files: paths)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as caught:
        manager.save(4, model, optimizer, {"position": 0})
        manager.wait()
    message = str(caught.value)
    assert "step 4 could not be written" in message and "rank 0: RuntimeError: " in message
    assert "unexpected pos 704 vs 598" in message and "Traceback" not in message
    assert "step-00000002, is intact" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]  # the partial save removed
    assert (root / "latest").read_text().strip() == "step-00000002"
