"""Is CheckpointManager.load's `set_state_dict` call redundant? (checkpoint/manager.py, after read_counted)

read_counted (DCP's load) writes the checkpoint into the tensors `get_state_dict` returned, and those are the live
ones: the model's parameters and buffers (DTensors under FSDP2, read into their local shards), and the optimizer's
state (`optimizer.state_dict()` packs the very exp_avg, exp_avg_sq and step tensors; `get_state_dict` first makes
them by a zero-gradient step at lr 0 when the optimizer has none yet). The rest of what `set_state_dict` would bring
is not kept anyway: the param_groups' non-tensor entries (lr, betas, ...) are replaced by this run's own right
after it (the run's config's, docs/checkpoints.md), and AdamW has no other non-tensor state (its step is a tensor).
So for the device's AdamW (foreach or fused) and for the `host` tier (FSDP2's CPU offload: the states are its CPU
DTensors) the read alone restores everything, and removing the call changes no figure.

It is not redundant for memory.model_states = host_optimizer (step/host_optimizer.py): the AdamW step runs on fp32
master copies of the weights in host memory, which are not state (not in the checkpoint) but copies of the weights,
taken again from the model before the next step only when HostOptimizer.load_state_dict has run (`_refresh`). That
is what `set_state_dict` calls; the in-place read never does. Without it the masters stay what they were before the
load, and the first step after it writes master + update over the loaded weights:
- on a resume, the masters are the fresh model's initial weights (get_state_dict's own initialising step took them
  before the read): step 4's loss after a resume at step 2 was 5.4818 where the uninterrupted run has 5.3319;
- on a rollback (train.on_nonfinite = rollback), they are the weights of the bad step being rolled back from.

Both tests below fail without the call; the device's AdamW beside them holds the same property (it passes either
way: the read alone suffices there, as above)."""

from pathlib import Path

import pytest
import torch

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.models.llama import Llama
from longctx.step.host_optimizer import HostOptimizer, forward_units

CFG = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 2, "heads": 2, "kv_heads": 1,
                                   "ffn_dim": 32, "vocab_size": 64}})
BATCHES = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(k)) for k in range(5)]


def _quiet(*_a, **_k):
    pass


def _model_and_optimizer(states: str, seed: int):
    model = Llama(CFG.model)
    model.init_weights(seed)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    if states == "host_optimizer":
        return model, HostOptimizer(groups, forward_units(model), **hyper)
    return model, torch.optim.AdamW(groups, **hyper, foreach=True)


def _step(model, optimizer, tokens) -> None:
    model(tokens, None, None, labels=tokens).backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model, optimizer) -> list[torch.Tensor]:
    """The model's weights once the step in flight (the host optimizer's, on its worker) is done."""
    if isinstance(optimizer, HostOptimizer):
        optimizer.finish_update()
    return [p.detach().clone() for p in model.parameters()]


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, keep=3, async_save=False, rank=0, world=1, layout={}, model_cfg={}, log=_quiet)


def _saved_at_step_2(states: str, root: Path):
    """(model, optimizer, manager, the checkpoint of step 2, the weights one more step from it makes)."""
    model, optimizer = _model_and_optimizer(states, seed=0)
    _step(model, optimizer, BATCHES[0])
    _step(model, optimizer, BATCHES[1])
    manager = _manager(root)
    manager.save(2, model, optimizer, sampler_state={})
    _step(model, optimizer, BATCHES[2])
    return model, optimizer, manager, root / "step-00000002", _weights(model, optimizer)


def _differences(mine: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [(a - b).abs().max().item() for a, b in zip(mine, ref)]


@pytest.mark.parametrize("states", ["device", "host_optimizer"])
def test_a_resume_steps_on_from_the_loaded_weights(states, tmp_path):
    """A fresh model (other initial weights) and optimizer load step 2's checkpoint; their step 3 is the saver's, to
    the bit (the same arithmetic on the same state)."""
    *_, ckpt, ref = _saved_at_step_2(states, tmp_path)
    model, optimizer = _model_and_optimizer(states, seed=1)
    _manager(tmp_path).load(ckpt, model, optimizer)
    _step(model, optimizer, BATCHES[2])
    assert max(_differences(_weights(model, optimizer), ref)) == 0.0


@pytest.mark.parametrize("states", ["device", "host_optimizer"])
def test_a_rollback_steps_on_from_the_loaded_weights(states, tmp_path):
    """The same model and optimizer, two steps past the checkpoint (its masters moved on with them), load step 2's
    checkpoint again, as a rollback does (train/rollback.py); their next step on step 3's batch is the saver's."""
    model, optimizer, manager, ckpt, ref = _saved_at_step_2(states, tmp_path)
    _step(model, optimizer, BATCHES[3])
    manager.load(ckpt, model, optimizer)
    _step(model, optimizer, BATCHES[2])
    assert max(_differences(_weights(model, optimizer), ref)) == 0.0
