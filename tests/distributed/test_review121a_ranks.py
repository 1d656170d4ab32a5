"""The in-training evaluation under hpz with a partition larger than one rank (4 ranks as 2 nodes of 2), where
parallel/fsdp/shard.py reshard_units gathers each block unit from its node-sharded copy (FSDP2's unshard()) before
resharding it, in the layout whose parts that pass could trip on, all at once: grouped units (lists: the unshard
goes through the group's first module), expert units of their own inside each block's (parallel.expert 2; not in
model.node_sharded_units), qwz's custom all-gather (the unshard's node gather must stay exact), FSDP2's CPU offload
(memory.model_states host), gradient accumulation, and an evaluation at step 0, before any forward or backward.

test_evalshard121_ranks.py checks the plain debug model; here, the MoE one in that layout: after every evaluation no
FSDP parameter group holds a node-sharded copy (was: every block's, 696,320 bytes a rank, held until the next
forward), the bytes held after an in-loop evaluation are those held before it, and the training is bit for bit
(losses, every rank's parameter shards) that of a run that does not evaluate."""

import hashlib

import pytest

from live_storage import held_bytes
from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

ARGS = ["--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300", "--train.seq_len=256",
        "--train.warmup_steps=2", "--checkpoint.final=false", "--model.preset=debug-moe", "--parallel.expert=2",
        "--parallel.zero_pp=hpz,qwz", "--parallel.ranks_per_node=2", "--parallel.zero_pp_block=64",
        "--parallel.grad_bucket_blocks=2", "--memory.model_states=host", "--train.global_batch=8",
        "--train.grad_accum=2", "--train.eval_batches=1"]
STEPS = 2

pytestmark = pytest.mark.slow  # two 4-rank runs: ~40 s on a 2-core CPU (the everyday loop keeps its 5 minutes)


def _silent(*_a, **_k):
    pass


def _copies(model) -> tuple[dict, int]:
    """FSDP2's own record (private, read only here): per parameter group not back to SHARDED or still holding
    node-sharded copies, its module's name, state and copies held; and how many parameters know the copy
    attribute at all (0 would mean this reading no longer sees FSDP2's copies)."""
    from torch.distributed.fsdp import FSDPModule

    held, known, seen = {}, 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            known += sum(hasattr(p, "_sharded_post_forward_param_data") for p in group.fsdp_params)
            copies = sum(getattr(p, "_sharded_post_forward_param_data", None) is not None for p in group.fsdp_params)
            if copies or group._sharded_state.name != "SHARDED":
                held[name] = (group._sharded_state.name, copies)
    return held, known


def _run(eval_interval, run_dir):
    """Each step's loss and a digest of this rank's parameter shards after it; evaluating every eval_interval (and
    once before the first step): around each evaluation, the bytes held and what FSDP2 still holds after it."""
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*ARGS, f"--train.steps={STEPS}",
                                             f"--train.eval_interval={eval_interval}", f"--train.run_dir={run_dir}"])
    trainer, shards, evals = Trainer(cfg, log=_silent), [], []
    own_step, own_eval = trainer.step, trainer.evaluate

    def step(n):
        out = own_step(n)
        digest = hashlib.sha256()
        for p in trainer.model.parameters():
            digest.update(p.to_local().detach().contiguous().numpy().tobytes())
        shards.append(digest.hexdigest())
        return out

    def measured():
        before = held_bytes()
        loss = own_eval()
        evals.append((before, held_bytes(), *_copies(trainer.model)))
        return loss

    trainer.step, trainer.evaluate = step, measured
    if eval_interval:
        trainer.evaluate()  # step 0: no forward, no backward yet
    result = trainer.run()
    return result.losses, shards, sorted(result.eval_losses), evals


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("review121a")
    return run_spawned_many(4, [("evaluated", _run, (1, f"{base}/evaluated")),
                                ("not evaluated", _run, (0, f"{base}/none"))], timeout=600)


def test_no_node_sharded_copy_is_held_after_any_evaluation(runs):
    for _, _, steps, evals in runs["evaluated"]:
        assert steps == list(range(1, STEPS + 1)) and len(evals) == STEPS + 1
        for _, _, held, known in evals:
            assert known > 0 and held == {}, held  # (was: every block unit's copies, e.g. layers.0: 16 tensors)
        # (from the first forward on, the MoE layers' call_tokens hook keeps its last block call's document ids and
        # places, 2,304 bytes here, parallel/expert/call_tokens.py: not FSDP's, so step 0's evaluation is left out)
        for before, after, _, _ in evals[1:]:
            assert after == before, (before, after, after - before)  # (was: 696,320 bytes more)


def test_training_after_those_evaluations_is_bit_identical_to_training_without(runs):
    for evaluated, plain in zip(runs["evaluated"], runs["not evaluated"]):
        assert plain[2] == [] and plain[3] == []
        assert len(evaluated[0]) == STEPS and evaluated[0] == plain[0]  # the losses, exactly
        assert evaluated[1] == plain[1]  # every step's parameter shards, to the bit
