"""The host budget of GliDe draft training (train/host_budget.py draft_states) under ctx 2: each rank's
counted host states are the bytes its ranks really hold, the draft's FSDP shards (host_optimizer: masters,
gradient buffers, moments; host: shards, gradient copies, moments and the frozen target's offloaded weight
shards), as tests/unit/test_host_budget_draft.py checks them on one process."""

import random

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=128",
         "--train.global_batch=4", "--train.warmup_steps=1"]


def _nbytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum(t.numel() * t.element_size() for t in (x.to_local() if isinstance(x, DTensor) else x for x in tensors))


def _held_and_counted(args, tier, run_dir):
    """(host-state bytes this rank's run allocated, the budget's model_states figure for it)."""
    from longctx.train.host_budget import rank_host_bytes
    from longctx.train.trainer import Trainer

    cfg = load_config(None, [*args, "--parallel.ctx=2", f"--memory.model_states={tier}", f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.run()
    opt = trainer.optimizer
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    if tier == "host_optimizer":
        opt.finish_update()
        held = _nbytes(opt.masters) + _nbytes(opt._grad_buffers) + _nbytes(moments)
    else:  # the draft's shards and their gradient copies, the moments, the target's offloaded shards
        draft = [p for g in opt.param_groups for p in g["params"]]
        held = 2 * _nbytes(draft) + _nbytes(moments) + _nbytes(trainer.model.target.parameters())
    return held, rank_host_bytes(cfg, trainer.rt.dims, "cpu", 2, 1e12)["model_states"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from longctx.train.trainer import Trainer

    base = tmp_path_factory.mktemp("draft-budget-ctx2")
    (base / "corpus").mkdir()
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(60):
        (base / "corpus" / f"doc{i:03d}.txt").write_text(
            " ".join(rng.choice(words) for _ in range(rng.randint(3, 200))) + "\n")
    args = [*QUIET, f"--data.corpus={base / 'corpus'}", "--data.tokenizer=byte"]
    target = load_config(None, [*args, "--model.layers=3", "--model.dim=64", "--model.ffn_dim=128", "--train.steps=1",
                                "--checkpoint.interval=1", f"--train.run_dir={base / 'target'}"])
    Trainer(target, log=lambda *a, **k: None).run()
    draft = [*args, f"--draft.target={base / 'target' / 'checkpoints'}", "--train.steps=1"]
    return run_spawned_many(2, [(tier, _held_and_counted, (draft, tier, f"{base}/{tier}"))
                                for tier in ("host_optimizer", "host")])


@pytest.mark.parametrize("tier", ["host_optimizer", "host"])
def test_each_rank_counts_the_host_states_it_holds(runs, tier):
    for held, counted in runs[tier]:
        assert held > 0 and counted == held, (tier, held, counted)
