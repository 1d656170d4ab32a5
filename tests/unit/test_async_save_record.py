"""An asynchronous save records the step it saved, not what the loop did while it was being written.

The manifest's `trained_positions` (config/positions.py: how far `longctx generate` trusts the weights,
and what a resume or an init_from carries forward) was read when the background thread committed the
save. The trainer raises it on the first step of a new stage, which runs while the previous step's
save is still being written: a checkpoint of a stage's last step at 64 tokens recorded the next
stage's 128. The record is now taken when the save starts, as the RNG and data position are.
Reference: the same save made synchronously."""

import json
import threading
from pathlib import Path

import torch

from longctx.checkpoint import manager as manager_module
from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.train.trainer import train


def _manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:08d}" / "manifest.json").read_text())


def _save(root: Path, async_save: bool, monkeypatch) -> dict:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ckpt = CheckpointManager(root, keep=2, async_save=async_save, rank=0, world=1, layout={"world": 1},
                             model_cfg={}, log=lambda *a: None)
    ckpt.trained_positions = 64
    ckpt.run_dir = "/runs/a"
    release = threading.Event()
    hash_files = manager_module.hash_files

    def slow_hash(*args, **kwargs):  # the background commit is still under way while the loop moves on
        if async_save:
            release.wait(timeout=30)
        return hash_files(*args, **kwargs)

    monkeypatch.setattr(manager_module, "hash_files", slow_hash)
    ckpt.save(3, model, optimizer, {"cursor": 3})
    ckpt.trained_positions = 128  # step 4 enters the next stage (train/trainer.py _enter_stage)
    ckpt.run_dir = "/runs/b"
    release.set()
    ckpt.wait()
    return _manifest(root, 3)


def test_an_async_save_records_the_positions_of_its_own_step(tmp_path, monkeypatch):
    sync = _save(tmp_path / "sync", False, monkeypatch)
    background = _save(tmp_path / "async", True, monkeypatch)
    assert sync["trained_positions"] == 64 and sync["run_dir"] == "/runs/a"
    assert background["trained_positions"] == sync["trained_positions"]
    assert background["run_dir"] == sync["run_dir"]


BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
        "--train.stages=64:3,128:2", "--train.steps=5", "--train.seq_len=128",
        "--checkpoint.interval=3", "--checkpoint.keep=3"]


def test_a_staged_run_with_async_saves_records_what_the_sync_run_does(tmp_path):
    records = {}
    for mode in ("false", "true"):
        run = tmp_path / f"async-{mode}"
        train(load_config("configs/debug.toml", [*BASE, f"--checkpoint.async={mode}", f"--train.run_dir={run}"]),
              log=lambda *a, **k: None)
        records[mode] = [_manifest(run / "checkpoints", s).get("trained_positions") for s in (3, 5)]
    assert records["false"] == [64, 128]
    assert records["true"] == records["false"]
