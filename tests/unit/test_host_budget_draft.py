"""The host budget of draft training (draft.target: a GliDe or Clover draft against a frozen target): the
optimizer's states, which the host tiers keep in host memory, are the draft's, not the target's. The
budget counted 16 bytes per parameter of the target (the run's model config is the target's) under
memory.model_states = host_optimizer: a 1-layer draft of an 8B target was counted 128 GB of host states
and refused on a node it fits. Here the figure is held against the bytes the run's HostOptimizer really
allocates (its fp32 masters, gradient buffers and AdamW moments after a step)."""

import random

import pytest

from longctx.config import load_config
from longctx.train.host_budget import rank_host_bytes
from longctx.train.trainer import Trainer

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64",
         "--train.global_batch=2", "--train.warmup_steps=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-budget-corpus")
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(60):
        (d / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 120))) + "\n")
    return [f"--data.corpus={d}", "--data.tokenizer=byte"]


@pytest.fixture(scope="module")
def target(tmp_path_factory, corpus):
    """A tiny target (3 layers) trained one step and saved: its checkpoints directory."""
    run = tmp_path_factory.mktemp("draft-budget-target")
    cfg = load_config(None, [*QUIET, *corpus, "--model.layers=3", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=1", "--checkpoint.interval=1", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run / "checkpoints"


def _allocated_host_states(optimizer) -> int:
    """Bytes of the HostOptimizer's host tensors: masters, gradient buffers, and the moments its steps made."""
    tensors = [*optimizer.masters, *optimizer._grad_buffers]
    tensors += [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_host_optimizer_counts_the_drafts_states_not_the_targets(tmp_path, corpus, target, kind):
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target}", f"--draft.kind={kind}", "--train.steps=1",
                             "--memory.model_states=host_optimizer", f"--train.run_dir={tmp_path / 'draft'}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.run()
    trainer.optimizer.finish_update()
    allocated = _allocated_host_states(trainer.optimizer)
    trained = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    assert allocated == 16 * trained  # (the measurement sees every state: masters, gradients, both moments)
    counted = rank_host_bytes(cfg, trainer.rt.dims, "cpu", 1, 1e12)["model_states"]
    assert counted == allocated, (counted, allocated)


def test_host_tier_counts_the_drafts_states_and_the_frozen_targets_weights(tmp_path, corpus, target):
    """Under memory.model_states = host the target is FSDP2-offloaded too (its fp32 weight shards, frozen: no
    gradients, no moments) and the draft's shards, their gradient copies and moments are in host memory."""
    from torch.distributed.tensor import DTensor

    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target}", "--train.steps=1",
                             "--memory.model_states=host", f"--train.run_dir={tmp_path / 'draft'}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.run()

    def nbytes(params):
        local = (p.to_local() if isinstance(p, DTensor) else p for p in params)
        return sum(t.numel() * t.element_size() for t in local)

    draft = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    target_weights = list(trainer.model.target.parameters())
    assert all(isinstance(p, DTensor) for p in target_weights)  # (the frozen target is an offloaded FSDP job too)
    allocated = 2 * nbytes(draft) + nbytes(moments) + nbytes(target_weights)  # (2: the weights, their gradients)
    counted = rank_host_bytes(cfg, trainer.rt.dims, "cpu", 1, 1e12)["model_states"]
    assert counted == allocated, (counted, allocated)
