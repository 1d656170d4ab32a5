"""A signal of checkpoint.on_signal that lands during a run's set-up (minutes at scale: the model, the checkpoint to
load, the data) stops the run as one during training does, exit code 75: a fresh run after its first step, saved; a
resumed run before any step, its resumed checkpoint being all it has. The loop used to catch the signals only from
its start, so such a signal killed the ranks (128 + its number: no requeue by a script that requeues on 75), and the
launcher said the run saved nothing on a signal. A set-up that fails lets the handlers go again."""

import os
import signal

import pytest

import longctx.train.trainer as trainer_module
from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, Preempted
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--checkpoint.on_signal=SIGUSR1"]


@pytest.fixture
def usr1():
    """SIGUSR1 recorded by the test, outside any run (so a signal the run leaves alone does not end pytest)."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: seen.append(1))
    yield seen
    signal.signal(signal.SIGUSR1, previous)


def _signal_in_set_up(monkeypatch, fail=False):
    build = trainer_module.build_training_model

    def building(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        if fail:
            raise RuntimeError("set-up failed")
        return build(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_training_model", building)


def test_a_signal_during_a_fresh_runs_set_up_stops_it_after_its_first_step(tmp_path, monkeypatch, usr1):
    handler = signal.getsignal(signal.SIGUSR1)
    _signal_in_set_up(monkeypatch)
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    with pytest.raises(Preempted, match="saved step 1 on SIGUSR1") as e:
        trainer.run()
    assert e.value.exit_code == REQUEUE_EXIT_CODE and usr1 == []
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()
    assert signal.getsignal(signal.SIGUSR1) == handler


def test_a_signal_during_a_resumed_runs_set_up_stops_it_before_any_step(tmp_path, monkeypatch, usr1):
    args = [*BASE, f"--train.run_dir={tmp_path}", "--train.steps=2"]
    Trainer(load_config(None, args), log=lambda *a, **k: None).run()
    _signal_in_set_up(monkeypatch)
    trainer = Trainer(load_config(None, [*args, "--train.steps=6", "--checkpoint.resume=auto"]),
                      log=lambda *a, **k: None)
    with pytest.raises(Preempted, match=r"SIGUSR1 came during set-up, before step 3: nothing was trained since "
                                        r"step 2.*--checkpoint.resume auto") as e:
        trainer.run()
    assert e.value.exit_code == REQUEUE_EXIT_CODE and usr1 == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002"]


def test_a_failed_set_up_lets_the_signals_go(tmp_path, monkeypatch, usr1):
    handler = signal.getsignal(signal.SIGUSR1)
    _signal_in_set_up(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="set-up failed"):
        Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path}"]), log=lambda *a, **k: None)
    assert signal.getsignal(signal.SIGUSR1) == handler
