"""The weights-only loads (checkpoint/manager.py: load_weights_into for model.init_from and eval,
load_model_weights for generate and export) refuse a checkpoint holding model tensors the model has no
place for, as a resume does: DCP reads only the keys it is asked for, so an untied checkpoint loaded into
a tied model would come without its output head, without a word. The model is left untouched."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from longctx.checkpoint.manager import CheckpointManager
from longctx.checkpoint.weights_only import load_model_weights, load_weights_into
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.config.load import to_dict
from longctx.models.llama import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=64"]


def _saved_untied(root: Path) -> Path:
    cfg = load_config(None, [*SMALL, "--model.tie_embeddings=false"])
    model = build_model(cfg.model)
    manager = CheckpointManager(root, keep=1, async_save=False, rank=0, world=1, layout={"world": 1},
                                model_cfg=to_dict(cfg)["model"], log=lambda *_: None)
    manager.save(1, model, torch.optim.AdamW(model.parameters()), {})
    return manager.resume_point("auto")[0]


def _tied():
    return build_model(load_config(None, [*SMALL, "--model.tie_embeddings=true"]).model, seed=1)


@pytest.mark.parametrize("load, fix", [
    (lambda path, model: load_weights_into(path, model, SimpleNamespace(rank=0, world=1)),
     "start from a checkpoint of the configured model"),
    (load_model_weights, "use the longctx version that wrote it"),
])
def test_a_weights_only_load_refuses_tensors_the_model_lacks(tmp_path, load, fix):
    path = _saved_untied(tmp_path)
    model = _tied()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    said = rf"model tensors that the configured model lacks \(output.weight\).*{fix}"
    with pytest.raises(CheckpointError, match=said):
        load(path, model)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # nothing was loaded


def test_a_weights_only_load_of_the_same_model_loads_every_tensor(tmp_path):
    path = _saved_untied(tmp_path)
    saved = build_model(load_config(None, [*SMALL, "--model.tie_embeddings=false"]).model).state_dict()
    model = build_model(load_config(None, [*SMALL, "--model.tie_embeddings=false"]).model, seed=1)
    assert not torch.equal(model.output.weight, saved["output.weight"])  # (another seed: a load must change it)
    load_model_weights(path, model)
    assert all(torch.equal(t, saved[n]) for n, t in model.state_dict().items())
