"""train.on_nonfinite with LONGCTX_FAULT=nonfinite@STEP (one process): `skip` leaves the weights of a
non-finite step exactly as they were and goes on, counting it; `stop` stops naming the step, its
update not applied; the guard itself skips the fused AdamW's update on the device (found_inf)."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError, TrainingError
from longctx.step.optimizer import guarded_step
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer

BASE = ["--train.steps=5", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--metrics.log_interval=1"]


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _run_recording(trainer):
    """Run, keeping the weights after every step."""
    after, step = {}, trainer.step

    def stepping(s):
        out = step(s)
        after[s] = _weights(trainer.model)
        return out

    trainer.step = stepping
    return trainer.run(), after


def test_skip_keeps_the_weights_of_a_non_finite_step_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    cfg = load_config(None, [*BASE, f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    result, after = _run_recording(trainer)
    assert all(torch.equal(after[3][n], after[2][n]) for n in after[2])  # step 3 applied nothing
    assert not all(torch.equal(after[4][n], after[3][n]) for n in after[3])  # step 4 trains again
    assert math.isnan(result.losses[2]) and all(math.isfinite(x) for i, x in enumerate(result.losses) if i != 2)
    assert trainer.skipped_steps == 1
    lines = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("kind") == "train"}
    assert "skipped_steps" not in lines[2] and lines[3]["skipped_steps"] == lines[5]["skipped_steps"] == 1


def test_stop_names_the_step_and_applies_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    cfg = load_config(None, [*BASE, "--train.on_nonfinite=stop", f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    after = {}
    step = trainer.step

    def stepping(s):
        out = step(s)
        after[s] = _weights(trainer.model)
        return out

    trainer.step = stepping
    with pytest.raises(TrainingError, match="at step 3 .*its update was not applied"):
        trainer.run()
    assert all(torch.equal(after[3][n], after[2][n]) for n in after[2])


def test_the_fused_adamw_skips_on_the_device():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(4)
    guarded_step(opt, torch.tensor(True))
    before, state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    assert not torch.equal(before, torch.ones(4))  # the finite step was applied
    p.grad = torch.full((4,), float("nan"))
    guarded_step(opt, torch.tensor(False))
    assert torch.equal(p.detach(), before) and all(torch.equal(v, state[k]) for k, v in opt.state[p].items())
    assert opt.found_inf is None


@pytest.mark.parametrize("fault", ["nonfinite", "spike@x", "nonfinite@x", "hang@3", "hang@x:3", "flood@3"])
def test_unknown_faults_are_refused(fault, monkeypatch, tmp_path):
    from longctx.faults import planned

    monkeypatch.setenv("LONGCTX_FAULT", fault)
    with pytest.raises(ConfigError, match="LONGCTX_FAULT"):
        planned("nonfinite")


def test_faults_name_their_steps_and_ranks(monkeypatch):
    from longctx.faults import planned

    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@5, spike@12,hang@1:3,enospc@2")
    assert planned("nonfinite") == {5} and planned("spike") == {12} and planned("enospc") == {2}
    assert planned("hang", rank=1) == {3} and planned("hang", rank=0) == set()


@pytest.mark.parametrize("flags, message", [
    (["--train.on_nonfinite=retry"], "on_nonfinite = .retry. is not one of the valid choices: skip, stop, rollback"),
    (["--train.on_nonfinite=rollback"], "rollback reloads the last checkpoint, but checkpoint.interval is 0"),
    (["--train.spike_factor=0.5"], "train.spike_factor must be 0"),
    (["--train.spike_window=0"], "train.spike_window must be at least 1"),
])
def test_bad_policy_is_a_config_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)
