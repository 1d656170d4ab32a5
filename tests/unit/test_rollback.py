"""train.on_nonfinite = rollback (one process), with LONGCTX_FAULT=nonfinite@STEP / spike@STEP: the run
reloads the newest checkpoint, takes the data position after the bad step and goes on after it;
the skipped window is recorded beside the checkpoints, and a resume from that checkpoint after a
crash continues exactly as the run that did not crash, without replaying the window. The device
side of the spike check (StepGuard) is checked against a median written here."""

import json
import statistics

import pytest
import torch

from longctx.config import load_config
from longctx.train.guard import StepGuard
from longctx.train.report import rolled_back_steps
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=4",
        "--train.on_nonfinite=rollback"]


def _quiet(*_a, **_k):
    pass


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _same(a, b) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


class Recorder:
    """Wraps a trainer's step: each call's step number, the weights it starts from, its batch tokens."""

    def __init__(self, trainer, crash_at_call: int | None = None):
        self.calls: list[tuple[int, dict, list]] = []
        step, batches = trainer.step, trainer.sampler.step_batches
        tokens = {}

        def step_batches(s):
            out = batches(s)
            tokens[s] = [b.tokens.clone() for b, _ in out]
            return out

        def stepping(s):
            if crash_at_call is not None and len(self.calls) == crash_at_call:
                raise RuntimeError("simulated crash")
            start = _weights(trainer.model)
            out = step(s)
            self.calls.append((s, start, tokens.pop(s)))
            return out

        trainer.sampler.step_batches = step_batches
        trainer.step = stepping

    def steps(self):
        return [s for s, _, _ in self.calls]

    def tokens(self, step, occurrence=-1):
        return [t for s, _, t in self.calls if s == step][occurrence]

    def start(self, step, occurrence=-1):
        return [w for s, w, _ in self.calls if s == step][occurrence]


def _trainer(tmp_path, name, extra, monkeypatch, fault="", base=BASE):
    monkeypatch.setenv("LONGCTX_FAULT", fault)
    cfg = load_config(None, [*base, *extra, f"--train.run_dir={tmp_path / name}"])
    return Trainer(cfg, log=_quiet)


@pytest.mark.parametrize("fault, extra, bad, back_to", [
    # non-finite at step 5, read at step 6 (log interval 3): step 6 ran after it and runs again
    ("nonfinite@5", ["--train.steps=9", "--metrics.log_interval=3"], 5, 4),
    # a spike: 1000 x the loss at step 7, over 3 x the median of the 3 steps before
    pytest.param("spike@7", ["--train.steps=9", "--metrics.log_interval=1", "--train.spike_factor=3",
                             "--train.spike_window=3"], 7, 4, marks=pytest.mark.slow),
])
def test_rollback_reloads_and_skips_the_window(fault, extra, bad, back_to, tmp_path, monkeypatch):
    clean = _trainer(tmp_path, "clean", extra, monkeypatch)
    ref = Recorder(clean)
    clean_result = clean.run()
    assert clean.rollbacks == 0  # no spike found in a healthy run

    trainer = _trainer(tmp_path, "faulty", extra, monkeypatch, fault)
    rec = Recorder(trainer)
    result = trainer.run()
    steps = trainer.cfg.train.steps
    read_at = bad if fault.startswith("spike") else 6
    # the steps up to the one whose read found the bad step, then again from the step after it
    assert rec.steps() == [*range(1, read_at + 1), *range(bad + 1, steps + 1)]
    assert trainer.rollbacks == 1 and trainer.skipped_steps == 0
    # the first pass saw the clean run's data; after the rollback, weights are the checkpoint's...
    assert all(torch.equal(a, b) for s in range(1, bad + 1) for a, b in zip(rec.tokens(s, 0), ref.tokens(s)))
    assert _same(rec.start(bad + 1), rec.start(back_to + 1, 0))
    # ...and the data goes on where the clean run was after the bad step: steps back_to+1..bad are skipped
    for s in range(bad + 1, steps + 1):
        assert all(torch.equal(a, b) for a, b in zip(rec.tokens(s), ref.tokens(s)))
    assert not _same(rec.start(bad + 1), ref.start(bad + 1))  # (the skipped updates are missing)
    records = [json.loads(x) for x in (trainer.ckpt.root / "rollbacks.jsonl").read_text().splitlines()]
    assert [(r["bad_step"], r["rolled_back_to"], r["skipped_steps"]) for r in records] == [
        (bad, back_to, [back_to + 1, bad])]
    assert len(result.losses) == len(clean_result.losses) == steps
    assert all(x == x and x < 100 for i, x in enumerate(result.losses) if i != bad - 1)
    line = [r for r in map(json.loads, (trainer.run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "train"][-1]
    assert line["rollbacks"] == 1
    # the plots shade the discarded steps (their records stay in metrics.jsonl)
    assert rolled_back_steps(trainer.run_dir) == [(back_to + 1, bad)] and rolled_back_steps(clean.run_dir) == []


def test_a_rollback_to_the_last_step_of_a_stage_starts_the_next_stage_afresh(tmp_path, monkeypatch):
    # bad step 3 is stage 1's last, read at step 4 in stage 2: steps 4.. get the clean run's batches
    base = [x for x in BASE if not x.startswith("--train.seq_len")]
    extra = ["--train.stages=64:3,128:3", "--checkpoint.interval=2", "--metrics.log_interval=2"]
    ref = Recorder(clean := _trainer(tmp_path, "clean", extra, monkeypatch, base=base))
    clean.run()
    rec = Recorder(faulty := _trainer(tmp_path, "faulty", extra, monkeypatch, "nonfinite@3", base=base))
    faulty.run()
    assert rec.steps() == [1, 2, 3, 4, 4, 5, 6] and faulty.rollbacks == 1
    for s in (4, 5, 6):
        assert all(torch.equal(a, b) for a, b in zip(rec.tokens(s), ref.tokens(s))), s
    assert _same(rec.start(4), rec.start(3, 0))  # from the checkpoint of step 2


@pytest.mark.slow
def test_a_resume_after_a_rollback_does_not_replay_the_window(tmp_path, monkeypatch):
    extra = ["--train.steps=9", "--metrics.log_interval=1"]
    whole = _trainer(tmp_path, "whole", extra, monkeypatch, "nonfinite@6")
    whole_rec = Recorder(whole)
    whole_losses = whole.run().losses
    assert whole_rec.steps() == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # read every step: found at 6, on at 7

    crashed = _trainer(tmp_path, "crashed", extra, monkeypatch, "nonfinite@6")
    Recorder(crashed, crash_at_call=7)  # dies in step 7, after the rollback, before the save of step 8
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.run()
    crashed.sampler.close()

    logs = []
    resumed = Trainer(load_config(None, [*BASE, *extra, f"--train.run_dir={tmp_path / 'crashed'}",
                                         "--checkpoint.resume=auto"]), log=logs.append)
    assert resumed.start_step == 6  # from the checkpoint of step 4, after the skipped step 6
    assert any("the data of steps 5-6 stays skipped" in str(x) for x in logs)
    rec = Recorder(resumed)
    losses = resumed.run().losses
    assert rec.steps() == [7, 8, 9]
    for s in (7, 8, 9):
        assert all(torch.equal(a, b) for a, b in zip(rec.tokens(s), whole_rec.tokens(s)))
    assert _same(rec.start(7), whole_rec.start(7))
    assert losses == pytest.approx(whole_losses[6:], rel=0, abs=1e-6)


def _abandoned_attempt(tmp_path, monkeypatch, extra):
    """A run that saved steps 4 and 8 and crashed in step 9: `latest` names step 8; its checkpoints."""
    first = _trainer(tmp_path, "run", extra, monkeypatch)
    Recorder(first, crash_at_call=8)
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.run()
    first.sampler.close()
    assert (first.ckpt.root / "latest").read_text().strip() == "step-00000008"
    return first.ckpt.root


def _resume(tmp_path, extra, checkpoint, logs):
    return Trainer(load_config(None, [*BASE, *extra, f"--train.run_dir={tmp_path / 'run'}",
                                      f"--checkpoint.resume={checkpoint}"]), log=logs.append)


def test_a_rollback_after_resuming_an_older_checkpoint_never_goes_to_the_abandoned_attempt(tmp_path, monkeypatch):
    extra = ["--train.steps=12", "--metrics.log_interval=1"]
    root = _abandoned_attempt(tmp_path, monkeypatch, extra)
    # again from step 4, saving every 3 steps: bad step 5 (`latest` still names the abandoned step 8) goes
    # back to step 4; bad step 9 to this run's step 6, not to the abandoned step 8 (before 9, but another run's)
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@5,nonfinite@9")
    logs = []
    resumed = _resume(tmp_path, [*extra, "--checkpoint.interval=3"], root / "step-00000004", logs)
    assert resumed.start_step == 4
    rec = Recorder(resumed)
    resumed.run()
    records = [json.loads(x) for x in (root / "rollbacks.jsonl").read_text().splitlines()]
    assert [(r["bad_step"], r["rolled_back_to"]) for r in records] == [(5, 4), (9, 6)]
    assert any("step 5: " in str(x) and "rolled back to the checkpoint of step 4" in str(x) for x in logs)
    assert rec.steps() == [*range(5, 13)] and resumed.rollbacks == 2
    assert _same(rec.start(6), rec.start(5)) and _same(rec.start(10), rec.start(7))


def test_a_failed_save_does_not_send_a_rollback_to_the_abandoned_attempts_latest(tmp_path, monkeypatch):
    extra = ["--train.steps=12", "--metrics.log_interval=1"]
    root = _abandoned_attempt(tmp_path, monkeypatch, extra)
    # again from step 4 at another lr: its save at step 6 fails (warn: it trains on), so `latest` still names the
    # abandoned step 8, before the bad step 9 but another attempt's weights: the rollback goes to this run's step 4
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@1,nonfinite@9")
    logs = []
    resumed = _resume(tmp_path, [*extra, "--checkpoint.interval=3", "--checkpoint.on_save_error=warn",
                                 "--train.lr=1e-3", "--checkpoint.allow_changes=true"], root / "step-00000004", logs)
    rec = Recorder(resumed)
    resumed.run()
    records = [json.loads(x) for x in (root / "rollbacks.jsonl").read_text().splitlines()]
    assert [(r["bad_step"], r["rolled_back_to"]) for r in records] == [(9, 4)]
    assert _same(rec.start(10), rec.start(5))  # (the weights this run resumed, not the abandoned step 8's)


def test_a_fresh_run_never_rolls_back_to_another_runs_checkpoint_in_a_shared_dir(tmp_path, monkeypatch):
    from longctx.errors import TrainingError

    shared = tmp_path / "shared"
    _trainer(tmp_path, "a", ["--train.steps=4", "--checkpoint.interval=2", f"--checkpoint.dir={shared}"],
             monkeypatch).run()
    # another run started afresh on the same checkpoint.dir (another lr): its bad step 6 precedes its first save,
    # and run a's step 4 is before it, but another run's weights
    fresh = _trainer(tmp_path, "c", ["--train.steps=8", "--checkpoint.interval=10", "--metrics.log_interval=1",
                                     "--train.lr=1e-3", f"--checkpoint.dir={shared}"], monkeypatch, "nonfinite@6")
    with pytest.raises(TrainingError, match="at step 6, and train.on_nonfinite = rollback, but no checkpoint"):
        fresh.run()
    assert not (shared / "rollbacks.jsonl").exists()  # (a resume of run a's step 4 would skip steps 5-6)


def test_a_rollback_past_a_damaged_checkpoint_from_elsewhere_stays_on_its_trajectory(tmp_path, monkeypatch):
    from longctx.checkpoint.manifest import read_manifest

    _trainer(tmp_path, "x", ["--train.steps=4", "--checkpoint.interval=2"], monkeypatch).run()
    theirs, shared = tmp_path / "x" / "checkpoints", tmp_path / "shared"
    _trainer(tmp_path, "u", ["--train.steps=2", "--checkpoint.interval=2", "--train.lr=1e-3",
                             f"--checkpoint.dir={shared}"], monkeypatch).run()  # another run's step 2 there
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@6")
    args = ["--train.steps=8", "--checkpoint.interval=10", "--metrics.log_interval=1", f"--checkpoint.dir={shared}",
            f"--train.run_dir={tmp_path / 'b'}", f"--checkpoint.resume={theirs / 'step-00000004'}"]
    resumed = Trainer(load_config(None, [*BASE, *args]), log=_quiet)
    (theirs / "step-00000004" / "trainer_state.json").write_text("{}")  # damaged after the resume loaded it
    resumed.run()
    records = [json.loads(x) for x in (shared / "rollbacks.jsonl").read_text().splitlines()]
    # back to the step 2 the resumed step 4 descends from, not to the other run's step 2 in checkpoint.dir
    assert [(r["bad_step"], r["rolled_back_to"]) for r in records] == [(6, 2)]
    assert records[0]["checkpoint"] == read_manifest(theirs / "step-00000002")["checksum"]


def test_a_rollback_with_only_a_damaged_checkpoint_before_the_bad_step_stops(tmp_path, monkeypatch):
    from longctx.errors import TrainingError

    extra = ["--train.steps=12", "--metrics.log_interval=1"]
    root = _abandoned_attempt(tmp_path, monkeypatch, extra)
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@6")
    resumed = _resume(tmp_path, extra, root / "step-00000004", [])
    (root / "step-00000004" / "trainer_state.json").write_text("{}")  # damaged after the resume loaded it
    # the abandoned step 8 is intact, but after the bad step: never gone "back" to
    with pytest.raises(TrainingError, match="at step 6, and train.on_nonfinite = rollback, but no checkpoint"):
        resumed.run()
    assert not (root / "rollbacks.jsonl").exists()


def test_no_checkpoint_before_the_bad_step_stops_with_a_clear_message(tmp_path, monkeypatch):
    from longctx.errors import TrainingError

    trainer = _trainer(tmp_path, "early", ["--train.steps=5", "--metrics.log_interval=1"], monkeypatch, "nonfinite@2")
    with pytest.raises(TrainingError, match="at step 2, and train.on_nonfinite = rollback, but no checkpoint"):
        trainer.run()


def test_the_spike_check_is_the_running_median():
    guard = StepGuard(spike_factor=2.0, spike_window=4, device=torch.device("cpu"))
    losses = [5.0, 4.0, 3.0, 4.5, 100.0, float("nan"), 3.5, 7.9, 8.1, 2.0]
    good_history, decisions = [], []
    for loss in losses:
        ok, spike = guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
        decisions.append((bool(ok), bool(spike)))
    # written independently (docs/running.md): a spike is a finite loss over 2 x the median of the last 4
    # good steps' losses, once 4 good steps were seen; a bad step's loss is not among them
    window = []
    for loss in losses:
        finite = loss == loss
        known = window[-4:]
        spike = finite and len(known) == 4 and loss > 2.0 * statistics.median(known)
        good_history.append((finite and not spike, spike))
        if finite and not spike:
            window.append(loss)
    assert decisions == good_history
    assert decisions[4] == (False, True) and decisions[5] == (False, False) and decisions[8] == (False, True)


def test_the_spike_check_stays_on_after_a_rollback(tmp_path, monkeypatch):
    # bad step 6 goes back to step 4; a spike at step 7, the first step after it, must be caught: the
    # spike check's window is the checkpoint's (steps 2-4), as a resume from step 4 has it, not empty
    # (the check then waited spike_window steps, and the 1000x update of step 7 was applied)
    extra = ["--train.steps=9", "--metrics.log_interval=1", "--train.spike_factor=3", "--train.spike_window=3"]
    trainer = _trainer(tmp_path, "run", extra, monkeypatch, "nonfinite@6,spike@7")
    result = trainer.run()
    records = [json.loads(x) for x in (trainer.ckpt.root / "rollbacks.jsonl").read_text().splitlines()]
    assert [(r["bad_step"], r["rolled_back_to"]) for r in records] == [(6, 4), (7, 4)]
    assert trainer.rollbacks == 2
    assert all(x == x and x < 100 for i, x in enumerate(result.losses) if i not in (5, 6))


def test_the_discarded_steps_are_read_from_a_checkpoint_dir_outside_the_run(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "ckpts"
    run.mkdir()
    elsewhere.mkdir()
    (run / "config.toml").write_text(f'[checkpoint]\ndir = "{elsewhere}"\n')
    assert rolled_back_steps(run) == []
    lines = [{"skipped_steps": [11, 14]}, {"skipped_steps": [3, 5]}]
    (elsewhere / "rollbacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert rolled_back_steps(run) == [(3, 5), (11, 14)]
