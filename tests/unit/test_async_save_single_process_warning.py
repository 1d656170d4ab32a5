"""A single-process run's DCP calls state their intent (no_dist=True), and manager.py silences DCP's "assuming the
intent is to save in a single process" warning around them; an async save's write runs in DCP's own thread after
that context was left, so `--checkpoint.async true` on one process printed the warning (a traceback-like
UserWarning line under the step lines) at its first save."""

import threading
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as saver

from longctx.checkpoint.manager import CheckpointManager


def test_a_single_process_async_save_warns_nothing(tmp_path, monkeypatch):
    # DCP's thread writes only once async_save has returned (as on a loaded machine; otherwise a race)
    returned, real_save, real_async_save = threading.Event(), saver.save, dcp.async_save

    def late_save(*args, **kwargs):
        returned.wait(30)
        return real_save(*args, **kwargs)

    def async_save(*args, **kwargs):
        try:
            return real_async_save(*args, **kwargs)
        finally:
            returned.set()

    monkeypatch.setattr(saver, "save", late_save)
    monkeypatch.setattr(dcp, "async_save", async_save)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path / "ckpt", keep=2, async_save=True, rank=0, world=1, layout={},
                                model_cfg={}, log=lambda *a, **k: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1, model, optimizer, {"position": 0})
        manager.wait()
    assert [str(w.message) for w in caught if "single process" in str(w.message)] == []
    assert (tmp_path / "ckpt" / "step-00000001" / "manifest.json").is_file()
