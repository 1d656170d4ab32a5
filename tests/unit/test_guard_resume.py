"""The spike check's window of recent losses (train/guard.py) is part of the training state: saved in
trainer_state.json beside the data position and restored on resume, so a resumed run skips the spike
an uninterrupted run skips; a checkpoint saved without it still loads (the window starts empty)."""

import json

import pytest
import torch

from longctx.config import load_config
from longctx.train.guard import StepGuard
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--train.seq_len=64", "--train.steps=9", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--checkpoint.interval=4", "--metrics.log_interval=1", "--train.spike_factor=3", "--train.spike_window=3"]
CPU = torch.device("cpu")


def _quiet(*_a, **_k):
    pass


def _decisions(guard, losses):
    out = []
    for loss in losses:
        ok, spike = guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
        out.append((bool(ok), bool(spike)))
    return out


@pytest.mark.parametrize("seen", [0, 2, 3, 7])  # empty, filling, just full, wrapped around
def test_the_window_round_trips_through_json(seen):
    history = [5.0, 4.0, float("nan"), 4.5, 100.0, 3.5, 4.2][:seen]
    after = [4.1, 30.0, 3.9, 4.0, 13.0, 4.4]
    whole = StepGuard(3.0, 3, CPU)
    _decisions(whole, history)
    state = json.loads(json.dumps(whole.state_dict(), allow_nan=False))  # strict JSON: no NaN written
    resumed = StepGuard(3.0, 3, CPU)
    resumed.load_state_dict(state)
    assert _decisions(resumed, after) == _decisions(whole, after)


def test_no_saved_window_is_an_empty_one():
    guard = StepGuard(3.0, 3, CPU)
    guard.load_state_dict(None)
    assert _decisions(guard, [4.0, 100.0, 4.0, 4.0]) == [(True, False)] * 4  # too early to check


def test_another_window_length_keeps_the_newest_losses():
    old = StepGuard(2.0, 4, CPU)
    _decisions(old, [100.0, 100.0, 1.0, 1.0])
    shorter = StepGuard(2.0, 2, CPU)  # the run resumes with train.spike_window = 2: the newest 2 (1, 1)
    shorter.load_state_dict(old.state_dict())
    assert _decisions(shorter, [50.0]) == [(False, True)]
    longer = StepGuard(2.0, 6, CPU)  # 6: the 4 saved, and the check waits for 2 more steps
    longer.load_state_dict(old.state_dict())
    assert _decisions(longer, [1.0, 1.0, 50.0]) == [(True, False), (True, False), (False, True)]


def _crash_and_resume(tmp_path, monkeypatch, name, without_guard_state=False):
    """The run crashed in step 5 (after the save of step 4) and resumed with --checkpoint.resume auto."""
    monkeypatch.setenv("LONGCTX_FAULT", "spike@6")
    crashed = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / name}"]), log=_quiet)
    if without_guard_state:  # as a checkpoint written before the window was saved
        crashed.ckpt.extra_state.pop("guard")
    run_until_crash(crashed, 5)
    saved = json.loads((tmp_path / name / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    resumed = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / name}", "--checkpoint.resume=auto"]),
                      log=_quiet)
    assert resumed.start_step == 4
    return resumed, resumed.run(), saved


def test_a_resumed_run_skips_the_spike_the_uninterrupted_run_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "spike@6")
    whole = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / 'whole'}"]), log=_quiet)
    whole_losses = whole.run().losses
    assert whole.skipped_steps == 1  # step 6: 1000 x the loss, over 3 x the median of steps 3-5

    resumed, result, saved = _crash_and_resume(tmp_path, monkeypatch, "crashed")
    assert resumed.skipped_steps == 1
    assert result.losses == whole_losses[4:]  # bit for bit: the same weights after the skipped step
    assert len(saved["guard"]["losses"]) == 3  # steps 2-4's losses, beside the data position

    # a checkpoint without the window (saved before it was kept) loads; the check waits for a full window
    old, _, saved = _crash_and_resume(tmp_path, monkeypatch, "old", without_guard_state=True)
    assert "guard" not in saved and old.skipped_steps == 0


def test_a_resume_after_a_rollback_starts_with_the_window_the_rollback_left(tmp_path, monkeypatch):
    """A rollback takes the window saved in the checkpoint it goes back to (the check stays on: a spike
    right after it is caught, not applied while a new window fills); a crash after it, resumed from that
    checkpoint, goes on after the bad step with the same window, so the second spike is treated alike."""
    monkeypatch.setenv("LONGCTX_FAULT", "spike@7,spike@9")
    extra = ["--train.steps=12", "--train.on_nonfinite=rollback"]
    whole = Trainer(load_config(None, [*BASE, *extra, f"--train.run_dir={tmp_path / 'whole'}"]), log=_quiet)
    whole_losses = whole.run().losses
    assert whole.rollbacks == 2  # step 7 back to step 4; step 9 back to step 8
    assert max(whole_losses[9:]) < 100  # (index 8 is the spike of step 9 itself, not applied)

    crashed = Trainer(load_config(None, [*BASE, *extra, f"--train.run_dir={tmp_path / 'crashed'}"]), log=_quiet)
    run_until_crash(crashed, lambda s: crashed.rollbacks)
    resumed = Trainer(load_config(None, [*BASE, *extra, f"--train.run_dir={tmp_path / 'crashed'}",
                                         "--checkpoint.resume=auto"]), log=_quiet)
    assert resumed.start_step == 7
    losses = resumed.run().losses
    # (the run's count, the rollback to step 4 before the crash included: test_rollbacks_count_resume.py)
    assert resumed.rollbacks == whole.rollbacks and losses == whole_losses[7:]
