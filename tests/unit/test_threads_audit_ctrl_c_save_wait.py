"""Ctrl-C (SIGINT) while the loop waits for the async save in flight lost that save: CheckpointManager.wait forgot
the save before waiting, so the KeyboardInterrupt left nothing in flight for the run's way out to commit, and the
exiting process killed the daemon thread that would have (a .tmp-* directory, swept away at the next start). The
end's wait for the run's last save was outside the way out altogether. Both are now committed before the
KeyboardInterrupt leaves Trainer.run."""

import signal
import threading
import time

import pytest

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2", "--checkpoint.async=true"]


def _ctrl_c_while_waiting_for(monkeypatch, interrupted_step: int) -> None:
    """SIGINT while the loop waits for the save of `interrupted_step`, whose commit then takes 1 s more."""
    waiting = threading.Event()
    wait, commit = CheckpointManager.wait, CheckpointManager._commit

    def watched_wait(self):
        if self._finishing is not None:
            waiting.set()
        return wait(self)

    def slow_commit(self, step, *args, **kwargs):
        if step == interrupted_step:
            assert waiting.wait(60)
            time.sleep(0.3)  # (the loop is inside the wait by then)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # (Ctrl-C: to the main thread)
            time.sleep(1.0)
        return commit(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "wait", watched_wait)
    monkeypatch.setattr(CheckpointManager, "_commit", slow_commit)


@pytest.mark.parametrize("steps, interrupted", [(6, 2), (4, 4)])  # the next save's wait; the end's
def test_ctrl_c_in_the_wait_for_a_save_commits_it(steps, interrupted, tmp_path, monkeypatch):
    # Ctrl-C as a shell's `longctx train` gets it: Python's own SIGINT handler, whatever an earlier test in this
    # worker left installed (torchrun's agent installs its own for good: CI saw its SignalException here)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _run_interrupted(steps, interrupted, tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_interrupted(steps, interrupted, tmp_path, monkeypatch):
    _ctrl_c_while_waiting_for(monkeypatch, interrupted)
    trainer = Trainer(load_config(None, [*BASE, f"--train.steps={steps}", f"--train.run_dir={tmp_path}"]),
                      log=lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    root = tmp_path / "checkpoints"
    assert (root / f"step-{interrupted:08d}" / "manifest.json").is_file()  # as the run returns (was a .tmp-*)
    assert (root / "latest").read_text().strip() == f"step-{interrupted:08d}"
    assert not list(root.glob(".tmp-*"))
