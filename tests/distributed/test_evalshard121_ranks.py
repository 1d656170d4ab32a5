"""What FSDP2 holds after forwards with no backward, counted as every live tensor's storage on the rank (gc).

- The in-training evaluation under hpz with a partition larger than one rank (4 ranks as 2 nodes of 2, each
  unit sharded over its node after forward): FSDP2's reshard() registers the sharded parameters again but keeps
  each block's node-sharded copy (FSDPParam.to_sharded frees only the gathered buffers) until the block's next
  forward. An evaluation left 1,574,912 bytes more held on every rank of the debug model (2.61 MB before, 4.18 MB
  after). parallel/fsdp/shard.py reshard_units now gathers each such unit from its copy, which frees it, before
  resharding; the training that follows is step for step (losses, every rank's parameter shards) the training
  of a run that does not evaluate.
- A GliDe draft's frozen target (train/glide.py _target), forward-only once per micro-batch, at 2 ranks: its
  block units reshard in their own post-forward (reshard_after_forward True, no_grad or not) and _target
  reshards the root, so nothing but its outputs stays: every unit sharded, no byte more held."""

import hashlib

import pytest
import torch

from live_storage import held_bytes
from longctx.config import load_config
from longctx.job.spawn import run_spawned, run_spawned_many

pytestmark = pytest.mark.slow  # three 4-rank runs and a 2-rank draft run: ~70 s on a 2-core CPU

BASE = ["--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300", "--train.seq_len=256",
        "--train.global_batch=4", "--train.warmup_steps=2", "--checkpoint.final=false"]
HPZ = ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2"]  # partition: the node's 2 of 4 ranks
STEPS = 3
DRAFT = ["--data.max_docs=40", "--train.seq_len=64", "--train.global_batch=4", "--metrics.plots=false",
         "--metrics.progress=false", "--train.device=cpu", "--model.layers=3"]


def _silent(*_a, **_k):
    pass


def _around_evaluation(run_dir):
    """One step and the evaluation at its end: the bytes held on entering the evaluation and on leaving it."""
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, *HPZ, "--train.steps=1", "--train.eval_interval=1",
                                             f"--train.run_dir={run_dir}"])
    trainer, held = Trainer(cfg, log=_silent), []
    own = trainer.evaluate

    def measured():
        held.append(held_bytes())
        loss = own()
        held.append(held_bytes())
        return loss

    trainer.evaluate = measured
    trainer.run()
    return held


def _steps(eval_interval, run_dir):
    """Each step's loss and a digest of this rank's parameter shards after it, evaluating every eval_interval."""
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, *HPZ, f"--train.steps={STEPS}",
                                             f"--train.eval_interval={eval_interval}", f"--train.run_dir={run_dir}"])
    trainer, shards = Trainer(cfg, log=_silent), []
    own = trainer.step

    def step(n):
        out = own(n)
        digest = hashlib.sha256()
        for p in trainer.model.parameters():
            digest.update(p.to_local().detach().contiguous().numpy().tobytes())
        shards.append(digest.hexdigest())
        return out

    trainer.step = step
    result = trainer.run()
    return result.losses, shards, sorted(result.eval_losses)


def _target_passes(target, run_dir):
    """A GliDe draft's two steps with an evaluation after each: around every target forward, the bytes held
    (its outputs left out) and whether each unit of the target and each parameter is sharded again."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from longctx.train.trainer import Trainer

    cfg = load_config(None, [*DRAFT, "--parallel.dp_shard=2", f"--draft.target={target}", "--train.steps=2",
                             "--train.eval_interval=1", "--checkpoint.final=false", f"--train.run_dir={run_dir}"])
    trainer, passes = Trainer(cfg, log=_silent), []
    model, own = trainer.model, trainer.model._target

    def measured(*args):
        before = held_bytes()
        out = own(*args)
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        plain = [n for n, p in model.target.named_parameters() if not isinstance(p, DTensor)]
        units = sum(isinstance(m, FSDPModule) for m in model.target.modules())
        passes.append((before, held_bytes(outputs), plain, units))
        return out

    model._target = measured
    trainer.run()
    return passes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("evalshard")
    jobs = [("held", _around_evaluation, (f"{base}/held",)),
            ("evaluated", _steps, (1, f"{base}/evaluated")),
            ("not evaluated", _steps, (0, f"{base}/none"))]
    return run_spawned_many(4, jobs, timeout=600)


@pytest.fixture(scope="module")
def target_passes(tmp_path_factory):
    base = tmp_path_factory.mktemp("evalshard-draft")
    cfg = load_config(None, [*DRAFT, "--train.steps=1", "--checkpoint.interval=1", "--train.eval_interval=0",
                             f"--train.run_dir={base}/target"])
    from longctx.train.trainer import Trainer

    Trainer(cfg, log=_silent).run()
    return run_spawned(2, _target_passes, f"{base}/target/checkpoints", f"{base}/draft", timeout=600)


def test_an_evaluation_under_hpz_leaves_no_node_sharded_copy_held(runs):
    for rank in runs["held"]:
        before, after = rank
        assert after == before, (before, after, after - before)  # (was: 1,574,912 bytes more on each rank)


def test_training_after_evaluations_under_hpz_is_bit_identical_to_training_without(runs):
    for evaluated, plain in zip(runs["evaluated"], runs["not evaluated"]):
        assert evaluated[2] == list(range(1, STEPS + 1)) and plain[2] == []
        assert len(evaluated[0]) == STEPS and evaluated[0] == plain[0]  # the losses, exactly
        assert evaluated[1] == plain[1]  # every step's parameter shards, to the bit


def test_a_glide_targets_forward_only_passes_leave_its_units_sharded(target_passes):
    for rank in target_passes:
        assert len(rank) > 2  # (the 2 steps' passes and the evaluations')
        for before, after, plain, units in rank:
            assert units > 1 and plain == []
            assert after <= before, (before, after)
