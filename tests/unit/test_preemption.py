"""checkpoint.on_signal on one process: a signal mid-run stops after that step with its checkpoint
saved (Preempted, exit code 75); the signals are checked when the config is read; a run that does
not save checkpoints leaves the signals alone."""

import os
import signal

import pytest

from longctx.config import load_config
from longctx.errors import REQUEUE_EXIT_CODE, ConfigError, Preempted
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu"]


def _signal_at(trainer, at: int, sig):
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == at:
            os.kill(os.getpid(), sig)
        return out

    trainer.step = stepping


@pytest.mark.parametrize("sig, periodic", [(signal.SIGTERM, True), (signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_a_signal_saves_that_step_and_stops(sig, periodic, tmp_path):
    """Periodic saves or none (checkpoint.final, the default, makes any run one that saves)."""
    cfg = load_config(None, [*BASE, f"--checkpoint.interval={100 if periodic else 0}", f"--train.run_dir={tmp_path}"])
    before = signal.getsignal(sig)  # (the run catches its signals from its set-up on: test_signal_during_set_up.py)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    _signal_at(trainer, 2, sig)
    with pytest.raises(Preempted, match=f"saved step 2 on {sig.name}") as e:
        trainer.run()
    assert e.value.exit_code == REQUEUE_EXIT_CODE == 75
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()
    assert signal.getsignal(sig) == before  # the handler is the run's only


def test_without_checkpoints_the_signal_is_not_taken(tmp_path):
    """checkpoint.interval 0 and checkpoint.final false: nothing to save, so the run does not catch
    the signals at all (with checkpoint.final, the default, a run saves its end and so takes them)."""
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}", "--checkpoint.final=false"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: seen.append(1))
    try:
        _signal_at(trainer, 2, signal.SIGUSR1)
        assert len(trainer.run().losses) == 6
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [1]


@pytest.mark.parametrize("value", ["SIGKILL", "SIGFOO", "TERM,9"])
def test_uncatchable_or_unknown_signals_are_a_config_error(value):
    with pytest.raises(ConfigError, match="checkpoint.on_signal"):
        load_config(None, [f"--checkpoint.on_signal={value}"])


def test_signal_names_with_or_without_sig():
    from longctx.config.rules import parse_signals

    assert parse_signals("TERM, usr1") == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_signals("") == parse_signals("none") == []


@pytest.mark.parametrize("at", [2, 3])
def test_a_signal_during_an_async_save_ends_with_intact_checkpoints(at, tmp_path):
    """The signal lands right after the async save of step 2 was handed to its thread (at=2: that
    save is the stop's checkpoint; at=3: step 3 is saved after it). Every checkpoint left is
    complete and verifies, and the newest is the step the run stopped at."""
    from longctx.checkpoint.manager import CheckpointManager

    cfg = load_config(None, [*BASE, "--checkpoint.interval=2", "--checkpoint.async=true",
                             f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    _signal_at(trainer, at, signal.SIGTERM)
    with pytest.raises(Preempted, match=f"saved step {at} on SIGTERM"):
        trainer.run()
    root = tmp_path / "checkpoints"
    found = sorted(p.name for p in root.glob("step-*"))
    assert found == [f"step-{s:08d}" for s in range(2, at + 1)]
    manager = CheckpointManager(root, keep=5, async_save=False, rank=0, world=1, layout={}, model_cfg={})
    for name in found:
        _, problems = manager.find_damage(root / name)
        assert not problems, (name, problems)
    assert not list(root.glob(".tmp-*"))
    path, _ = manager.resume_point("auto")
    assert path.name == f"step-{at:08d}"
