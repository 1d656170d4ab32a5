"""A resumed run's TensorBoard mirror (metrics.tensorboard) reads as one run, as its metrics file does.

A resume from a checkpoint older than the run's last logged step moves the records of the steps past it out of
metrics.jsonl (train/setup.py continue_run_files), but the events of those steps stayed in <run_dir>/tensorboard:
a crash at step 6 after the save of step 4 left TensorBoard's loss curve with steps 5-6 twice (the abandoned
attempt's values beside the resumed run's: steps [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]). torch's SummaryWriter takes a
`purge_step` for this: TensorBoard hides the earlier events at and past it. A fake SummaryWriter (tensorboard
itself is an optional package) records what a writer was given and what it wrote; the view below applies
TensorBoard's purge to it."""

import sys
import types

import pytest

from longctx.config import load_config
from longctx.train import trainer as trainer_mod
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--train.steps=8", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=4", "--metrics.log_interval=1", "--metrics.tensorboard=true"]


class _FakeSummaryWriter:
    made: list = []  # every writer, in the order the runs made them

    def __init__(self, log_dir, purge_step=None, **_):
        self.log_dir, self.purge_step, self.events = log_dir, purge_step, []
        _FakeSummaryWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.events.append((tag, value, step))

    def close(self):
        pass


@pytest.fixture
def fake_tensorboard(monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(trainer_mod, "check_packages", lambda cfg: None)  # (the package itself is not needed)
    _FakeSummaryWriter.made = []
    return _FakeSummaryWriter


def _tensorboard_view(writers, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard shows the writers' events: a writer's purge_step hides the events
    written before it at that step or later."""
    shown: list[tuple[str, float, int]] = []
    for w in writers:
        if w.purge_step is not None:
            shown = [e for e in shown if e[2] < w.purge_step]
        shown += w.events
    return [(step, value) for t, value, step in shown if t == tag]


def test_a_resumed_runs_tensorboard_shows_each_step_once(tmp_path, fake_tensorboard):
    args = [*BASE, f"--train.run_dir={tmp_path / 'run'}"]
    crashed = Trainer(load_config(None, args), log=lambda *a, **k: None)
    run_until_crash(crashed, 7)  # after step 6's line; the newest checkpoint is step 4's
    resumed = Trainer(load_config(None, [*args, "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert resumed.start_step == 4
    resumed.run()

    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 9))  # (the file: each step once)
    first, second = fake_tensorboard.made
    assert first.purge_step is None  # (a fresh run hides nothing)
    shown = _tensorboard_view([first, second], "train/loss")
    assert [s for s, _ in shown] == list(range(1, 9))
    assert shown == [(r["step"], r["loss"]) for r in records]  # the resumed run's values of steps 5-6
