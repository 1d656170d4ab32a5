"""A Trainer built and not run (a bench or a test driving `trainer.step`, one of two Trainers in one process) leaves
the process's signal handlers as they were: the set-up's EarlySignals let go at its end and run() catches them again.
They used to stay installed, so the process recorded checkpoint.on_signal's SIGTERM and went on, never ending."""

import signal

from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--train.steps=2", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--checkpoint.on_signal=SIGUSR1"]


def test_a_trainer_built_and_not_run_keeps_no_handler(tmp_path):
    handler = signal.getsignal(signal.SIGUSR1)
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / 'a'}"]), log=lambda *a, **k: None)
    trainer.step(1)
    assert signal.getsignal(signal.SIGUSR1) == handler
    # a second Trainer run to the end in the same process restores the same handler
    Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / 'b'}"]), log=lambda *a, **k: None).run()
    assert signal.getsignal(signal.SIGUSR1) == handler
