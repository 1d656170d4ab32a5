"""A checkpoint saved when every step so far was skipped (train.on_nonfinite = skip) leaves the run as it
would be unsaved. The CPU run's foreach AdamW makes no state for a skipped step, and DCP's get_state_dict
then made one by a step of zero gradients at lr 0 that it counted: each later update bias-corrected one
step late (loss off by 0.1 within 4 steps, an audit's finding). A skipped step now leaves the state a fused
kernel's skipped step leaves: AdamW's step 0 and zero moments, what a first update starts from."""

import torch

from longctx.config import load_config
from longctx.step.optimizer import fresh_state
from longctx.train.trainer import train

BASE = ["--train.steps=4", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--train.on_nonfinite=skip", "--train.warmup_steps=1"]


def test_a_save_after_a_skipped_first_step_changes_no_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@1")
    unsaved = train(load_config(None, [*BASE, "--checkpoint.final=false", f"--train.run_dir={tmp_path / 'a'}"]),
                    log=lambda *a, **k: None).losses
    saved = train(load_config(None, [*BASE, "--checkpoint.interval=1", f"--train.run_dir={tmp_path / 'b'}"]),
                  log=lambda *a, **k: None).losses
    assert len(saved) == 4 and saved[1:] == unsaved[1:]  # (step 1's loss is the fault's NaN in both)


def test_the_fresh_state_is_a_fresh_adamws():
    """One update from fresh_state's state equals one from no state, for the foreach and the plain AdamW."""
    for foreach in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        a = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=foreach)
        b = torch.optim.AdamW(copies, lr=0.1, weight_decay=0.1, foreach=foreach)
        fresh_state(b)
        assert all(p.grad is None for p in copies) and b.param_groups[0]["lr"] == 0.1
        assert torch.equal(copies[0], params[0]) and float(b.state[copies[0]]["step"]) == 0.0
        for p, q in zip(params, copies):
            p.grad = q.grad = torch.ones_like(p)
        a.step()
        b.step()
        assert all(torch.equal(p, q) for p, q in zip(params, copies))


def test_the_resumed_run_after_a_skipped_first_step_is_the_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@1")
    whole = train(load_config(None, [*BASE, "--checkpoint.interval=1", "--checkpoint.keep=5",
                                     f"--train.run_dir={tmp_path}"]),
                  log=lambda *a, **k: None).losses
    monkeypatch.delenv("LONGCTX_FAULT")
    step1 = next(p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith("00001"))
    resumed = train(load_config(None, [*BASE, f"--checkpoint.resume={step1}", f"--train.run_dir={tmp_path / 'r'}"]),
                    log=lambda *a, **k: None).losses
    assert resumed[-3:] == whole[1:]
