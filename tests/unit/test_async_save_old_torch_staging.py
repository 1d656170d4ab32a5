"""checkpoint/manager.py on a torch without DCP's DefaultStager (torch 2.6 to 2.8, which pyproject allows): its
async_save stages by `.to("cpu")`, which copies nothing already in host memory, so the background write read the
live weights and moments that the next steps change in place (a CPU run's, the host tiers' master states). The
save now hands async_save copies (checkpoint/background.py host_copies): checked by what async_save receives,
which must share no storage with the model or the optimizer, and by the checkpoint holding the step it was asked
for after the model moved on."""

import torch
import torch.distributed.checkpoint as dcp

import longctx.checkpoint.manager as manager_module
from longctx.checkpoint.manager import CheckpointManager
from longctx.checkpoint.weights_only import load_model_weights


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def test_an_async_save_without_defaultstager_hands_dcp_copies_of_host_tensors(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    live = _storages([*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())])
    monkeypatch.setattr(manager_module, "reusable_stager", lambda: None)  # (a torch without DefaultStager)
    real_async_save, handed = dcp.async_save, []

    def async_save(state, **kwargs):
        moments = [t for s in state["optim"]["state"].values() for t in s.values()]
        handed.append(_storages([*state["model"].values(), *moments]) & live)
        return real_async_save(state, **kwargs)

    monkeypatch.setattr(manager_module.dcp, "async_save", async_save)
    manager = CheckpointManager(tmp_path / "ckpt", keep=2, async_save=True, rank=0, world=1, layout={}, model_cfg={},
                                log=lambda *a, **k: None)
    manager.run_dir = str(tmp_path / "run")
    manager.save(1, model, optimizer, {"position": 0})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step, in place, while the write may still run
    manager.wait()
    assert handed == [set()], "async_save was handed the live model's or optimizer's tensors"
    loaded = torch.nn.Linear(4, 3)
    load_model_weights(tmp_path / "ckpt" / "step-00000001", loaded)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
