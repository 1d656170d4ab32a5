"""A resume that changes train.weight_decay, beta1 / beta2 or eps trains with the new values (the resume
line announces them): loading a checkpoint restores the optimizer's state, not the saver's
hyper-parameters, under the device's AdamW and HostOptimizer alike (checkpoint/manager.py,
step/host_optimizer.py). The no-decay group keeps its 0; lr is the schedule's, set every step."""

import pytest
import torch

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.models.llama import Llama
from longctx.step.host_optimizer import HostOptimizer, forward_units
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=2"]
CHANGES = ["--train.weight_decay=0.0", "--train.beta1=0.8", "--train.beta2=0.99", "--train.eps=1e-6"]


def _quiet(*_a, **_k):
    pass


def _hyper(group):
    return {k: v for k, v in group.items() if k not in ("params", "lr")}


@pytest.mark.parametrize("states", ["device", "host_optimizer"])
def test_a_resume_applies_the_changed_hyper_parameters(states, tmp_path):
    run = [*BASE, f"--memory.model_states={states}", f"--train.run_dir={tmp_path / 'run'}"]
    Trainer(load_config(None, [*run, "--train.steps=2"]), log=_quiet).run()
    cfg, resumed = load_run_config(None, ["--checkpoint.resume=auto", f"--train.run_dir={tmp_path / 'run'}",
                                          "--train.steps=4", *CHANGES], layout_given=False)
    assert "train.beta2 0.95 -> 0.99" in resumed.describe()
    trainer = Trainer(cfg, log=_quiet)
    assert trainer.start_step == 2
    decay, no_decay = trainer.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.0, 0.0)
    for group in (decay, no_decay):
        assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6
    # the groups are exactly those a fresh run with this config builds, the state the checkpoint's
    fresh = Trainer(load_config(None, [*run[:-1], *CHANGES, f"--train.run_dir={tmp_path / 'fresh'}"]), log=_quiet)
    assert [_hyper(g) for g in trainer.optimizer.param_groups] == [_hyper(g) for g in fresh.optimizer.param_groups]
    assert len(trainer.optimizer.state) == len(list(trainer.model.parameters()))
    trainer.run()
    if states == "host_optimizer":  # what the host AdamW steps with
        for inner, _ in trainer.optimizer._inner:
            assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in inner.param_groups)


CFG = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 2, "heads": 2, "kv_heads": 1,
                                   "ffn_dim": 32, "vocab_size": 64}})


def _host(model, weight_decay, betas, eps):
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return HostOptimizer(groups, forward_units(model), lr=1e-2, betas=betas, eps=eps)


def test_host_optimizer_loads_the_state_and_keeps_its_hyper_parameters():
    model = Llama(CFG.model)
    model.init_weights(0)
    opt = _host(model, 0.1, (0.9, 0.95), 1e-8)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, None, None, labels=tokens).backward()
    opt.step()
    saved = opt.state_dict()
    other = Llama(CFG.model)
    other.init_weights(0)
    opt2 = _host(other, 0.0, (0.8, 0.99), 1e-6)
    opt2.load_state_dict(saved)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.0, 0.0]
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in opt2.param_groups)
    assert all(torch.equal(opt2.state[b]["exp_avg"], opt.state[a]["exp_avg"])
               for a, b in zip(model.parameters(), other.parameters()))
