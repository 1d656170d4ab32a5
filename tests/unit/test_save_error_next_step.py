"""A run stopped by a failed save (checkpoint.on_save_error = stop, or a stop on a signal whose own save fails) says
what to do next, as a full disk at a metrics line does: free space, then resume from the checkpoint that was kept (or
start again when none was). Its message once said only what failed and what was kept, and the run exited 1 with no
word on how to go on."""

import os
import signal

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2"]


@pytest.mark.parametrize("fault, advice", [
    ("enospc@2", r"checkpoint.on_save_error = warn trains on past a failed save and tries again at the next save\.$"),
    ("enospc@1", r".*tries again at the next save\. Start the run again once it is fixed: no checkpoint was saved"),
])
def test_a_failed_save_says_how_to_go_on(tmp_path, monkeypatch, fault, advice):
    monkeypatch.setenv("LONGCTX_FAULT", fault)
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}"])
    with pytest.raises(CheckpointError, match=r"could not be written .*To fix it: free space there.*The run stops "
                                              r"\(checkpoint.on_save_error = stop\); " + advice):
        Trainer(cfg, log=lambda *a, **k: None).run()


def test_a_stop_whose_own_save_fails_says_how_to_go_on(tmp_path, monkeypatch):
    """Under warn the stop on a signal saves its step again, and that save fails too (enospc@2 and @3)."""
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2,enospc@3")
    cfg = load_config(None, [*BASE, "--checkpoint.on_save_error=warn", f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    step = trainer.step

    def signalled(s):  # SIGTERM during step 4, whose due save fails (the 2nd); the stop's own (the 3rd) fails too
        if s == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(s)

    trainer.step = signalled
    with pytest.raises(CheckpointError, match=r"step 4 could not be written .*--checkpoint.resume auto then continues "
                                              r"from step-00000002 \(with another --checkpoint.dir, --checkpoint.resume"
                                              r" \S+step-00000002\)\. The run stops \(the stop's own save failed\)\.$"):
        trainer.run()


def test_a_stop_whose_own_save_fails_under_stop_does_not_offer_warn(tmp_path, monkeypatch):
    """Under stop (the default) the stop's own save (the 2nd: step 3, after step 2's) fails: warn would not have
    trained on past it (a stop's own save raises whatever the policy), so the message does not offer warn."""
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    step = trainer.step

    def signalled(s):
        if s == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(s)

    trainer.step = signalled
    with pytest.raises(CheckpointError, match=r"step 3 could not be written .*continues from step-00000002 \(.*\)\. "
                                              r"The run stops \(the stop's own save failed\)\.$"):
        trainer.run()
