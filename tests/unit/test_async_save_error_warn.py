"""checkpoint.on_save_error = warn under --checkpoint.async: an async save's failure surfaces only when the
next save (or the stop on a signal) waits for it. That wait once ran inside the next save's own error
handler, so the failure of step 4's save also cancelled step 6's, the run's last: it ended with exit 0,
said only "step 4 could not be written ... Training goes on", and left step-00000002 as its newest
checkpoint. On a signal the same failure escaped the warn policy: the run stopped with the CheckpointError
(no exit 75, nothing requeued) instead of saving the step it stopped at. Each save is tried on its own."""

import os
import signal

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import LATEST
from longctx.errors import Preempted
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--checkpoint.async=true", "--checkpoint.on_save_error=warn",
        "--checkpoint.keep=5"]


def _left(run_dir):
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step-*")), (root / LATEST).read_text().strip()


def test_the_save_after_a_failed_async_save_is_still_made(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")  # step 4's save meets a full disk, in the background
    said = []
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]),
                      log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert len(trainer.run().losses) == 6
    names, latest = _left(tmp_path)
    assert names == ["step-00000002", "step-00000006"] and latest == "step-00000006"
    assert any("step 4 could not be written" in s and "Training goes on" in s for s in said)


@pytest.mark.parametrize("at", [4, 5])
def test_a_signal_after_a_failed_async_save_saves_its_step_and_asks_to_be_requeued(at, tmp_path, monkeypatch):
    """at=4: the failed save is the stop's own step's (it is saved again); at=5: it is the previous one, still
    in flight when the stop saves step 5."""
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = stepping
    with pytest.raises(Preempted, match=f"saved step {at} on SIGTERM"):
        trainer.run()
    names, latest = _left(tmp_path)
    assert names == ["step-00000002", f"step-{at:08d}"] and latest == f"step-{at:08d}"
