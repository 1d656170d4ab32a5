"""The weights after an in-training evaluation (train/evaluation.py), a forward with no backward: FSDP2 reshards a
unit in its backward, so after the evaluation the root unit (embeddings, final norm, LM head: FSDP2 never reshards
the root after forward) and, under hpz with a one-rank partition (reshard_after_forward False), every block kept
its gathered copy. `model.parameters()` then returned plain tensors, not the DTensors the optimizer updates
(`full_tensor` raised), the copies held their memory across the gap, and at one rank under
memory.model_states = host (a one-rank FSDP group) gradients.py read the root's mesh as None: the first
micro-batch after each evaluation kept its gradients unsharded on the device instead of sending them to the
host tier. parallel/fsdp/shard.py reshard_units puts every unit back; the training losses are those of a run
that does not evaluate."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned, run_spawned_many

BASE = ["--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300", "--train.seq_len=256",
        "--train.global_batch=2", "--train.warmup_steps=2", "--checkpoint.final=false"]
HPZ = ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2", "--parallel.hpz_ranks=1"]  # blocks: False
STEPS = 4


def _silent(*_a, **_k):
    pass


def _held_bytes(model) -> int:
    """Bytes of the distinct storages behind the tensors `model.parameters()` returns (a DTensor's: its shard)."""
    storages = {}
    for p in model.parameters():
        st = (p.to_local() if hasattr(p, "to_local") else p).untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _after_evaluation(args, run_dir):
    """One step, then the evaluation at its end (the run's last step): the parameters' kinds, whether they are the
    optimizer's, the bytes they hold before the run and after, and what full_tensor() made of them."""
    from torch.distributed.tensor import DTensor

    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, *args, "--train.steps=1", "--train.eval_interval=1",
                                             f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=_silent)
    owned = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    before = _held_bytes(trainer.model)
    result = trainer.run()
    params = dict(trainer.model.named_parameters())
    plain = sorted(name for name, p in params.items() if not isinstance(p, DTensor))
    try:
        full = sum(float(p.full_tensor().double().sum()) for p in params.values())
    except AttributeError as e:  # (a plain tensor has no full_tensor)
        full = str(e)
    return {"plain": plain, "optimizer's": {id(p) for p in params.values()} == owned,
            "held": (before, _held_bytes(trainer.model)), "full": full, "evaluated": list(result.eval_losses)}


def _losses(args, run_dir):
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.steps={STEPS}", f"--train.run_dir={run_dir}"])
    result = train(cfg, log=_silent)
    return result.losses, sorted(result.eval_losses)


def _syncs_around_an_evaluation(run_dir):
    """One rank, memory.model_states = host, 2 micro-batches a step, an evaluation after step 1: what each
    micro-batch asked FSDP for (gradients reduced to the host tier, or kept unsharded on the device)."""
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, "--train.steps=2", "--train.eval_interval=1",
                                             "--train.grad_accum=2", "--memory.model_states=host",
                                             f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=_silent)
    model, asked = trainer.model, []
    own = model.set_requires_gradient_sync

    def recorded(enabled, *args, **kwargs):
        asked.append(bool(enabled))
        return own(enabled, *args, **kwargs)

    model.set_requires_gradient_sync = recorded  # (an instance attribute: gradients.py calls it by name)
    trainer.run()
    return asked


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("evalparams")
    jobs = [("plain", _after_evaluation, ([], f"{base}/plain")),
            ("hpz", _after_evaluation, (HPZ, f"{base}/hpz")),
            ("hpz evaluated", _losses, ([*HPZ, "--train.eval_interval=1"], f"{base}/hpz-eval")),
            ("hpz not evaluated", _losses, ([*HPZ, "--train.eval_interval=0"], f"{base}/hpz-none"))]
    got = run_spawned_many(2, jobs, timeout=300)
    got["one rank"] = run_spawned(1, _syncs_around_an_evaluation, f"{base}/one", timeout=300)
    return got


@pytest.mark.parametrize("layout", ["plain", "hpz"])
def test_the_parameters_after_an_evaluation_are_the_optimizers_sharded_ones(runs, layout):
    for rank in runs[layout]:
        assert rank["evaluated"] == [1]
        assert rank["plain"] == [], rank["plain"][:4]  # (was: the root's, and under hpz every block's too)
        assert rank["optimizer's"]
        assert isinstance(rank["full"], float), rank["full"]  # (was: "'Parameter' object has no attribute ...")


@pytest.mark.parametrize("layout", ["plain", "hpz"])
def test_an_evaluation_leaves_no_gathered_copy_held(runs, layout):
    for rank in runs[layout]:
        before, after = rank["held"]
        assert after == before, (layout, before, after)


def test_training_after_evaluations_is_training_without_them(runs):
    for evaluated, plain in zip(runs["hpz evaluated"], runs["hpz not evaluated"]):
        assert evaluated[1] == list(range(1, STEPS + 1)) and plain[1] == []
        assert len(evaluated[0]) == STEPS and evaluated[0] == plain[0]


def test_one_rank_host_tier_reduces_every_micro_batch_after_an_evaluation(runs):
    assert runs["one rank"] == [[True, True, True, True]]  # (was: step 2's first micro-batch False)
